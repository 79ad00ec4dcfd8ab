"""The emulator on a simulated clock (emulate/clock.py, emulate/async_fleet.py, `figure async`): device times
worked out by hand from FedScale's semantics, the order of events, a run resumed bit for bit, the figure.

The runs are tiny (digits at 16x16, 3-4 clients, MobileNet-v1 x0.25, one epoch): what is checked is when
devices train and what the clock says, not accuracy."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedper.emulate.async_fleet import ClockConfig, ClockedFleet, ClockRunConfig, run_clocked
from fedper.emulate.cli import app
from fedper.emulate.clock import Device, device_from_trace, fleet_from_trace, load_trace, synthetic_trace
from fedper.emulate.data import DataConfig, load_fleet_data
from fedper.emulate.fleet import FleetConfig

# computation ms per sample (FedScale: a training sample costs 3 of them); at this bandwidth a model's download
# and upload take under 1e-7 s, within the tolerance TRANSFER of the hand-computed times
FAST, MEDIUM, SLOW = 1.0, 5.0, 50.0
FAST_LINK = 1e12
TRANSFER = 1e-6


def _trace(tmp_path: Path, computation: list[float], spells: list[tuple[list[int], list[int]]] | None = None,
           period: int = 10**6) -> str:
    """A FedScale-format trace, every device online throughout unless `spells` says otherwise."""
    spells = spells or [([0], [period])] * len(computation)
    trace = {"client_device_capacity": {str(j): {"computation": c, "communication": FAST_LINK}
                                        for j, c in enumerate(computation)},
             "client_behave_trace": {str(j): {"active": a, "inactive": i, "finish_time": period, "duration": period,
                                              "model": "test"} for j, (a, i) in enumerate(spells)}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    return str(path)


def _config(trace: str, mode: str, **clock) -> ClockRunConfig:
    return ClockRunConfig(
        DataConfig(dataset="digits", clients=len(json.loads(Path(trace).read_text())["client_device_capacity"]),
                   classes_per_client=4, input_size=16, scale=0.3),
        FleetConfig(model="mobilenet_v1", width=0.25, algorithm="fedper", kp=2, local_epochs=1, batch_size=32,
                    lr=0.05, momentum=0.9),
        ClockConfig(mode=mode, trace=trace, **clock), "cpu")


def _releases(config: ClockRunConfig) -> tuple[ClockedFleet, list[dict], list[int]]:
    clocked = ClockedFleet(config, load_fleet_data(config.data))
    state, history = clocked.init(), []
    while state.uploads < config.clock.uploads:
        history.append(clocked.release(state))
    return clocked, history, state.trainings


def test_device_spells_by_hand() -> None:
    """Online in [10, 20) and [30, 50) of every 60 s; FedScale's training cost 3 x computation ms per sample."""
    device = device_from_trace({"computation": 10.0, "communication": 8.0},
                               {"active": [30, 10, 15], "inactive": [50, 18, 20], "finish_time": 60}, "test")
    assert device.spells == ((10.0, 20.0), (30.0, 50.0))  # [10, 18] and [15, 20] merged
    assert [device.online(t) for t in (5, 10, 19.5, 20, 45, 75)] == [False, True, True, False, True, True]
    assert [device.next_online(t) for t in (5, 12, 25, 55)] == [10, 12, 30, 70]
    assert device.online_until(12) == 20 and device.online_until(75) == 80
    assert device.longest_online() == 20
    # 100 samples x 2 epochs x 0.03 s, and 2,000 bytes = 16 kbit at 8 kbit/s
    assert device.job_seconds(100, 2, 1000, 1000) == pytest.approx(6.0 + 2.0, rel=1e-12)
    wrapping = Device(1.0, 1.0, ((0.0, 10.0), (50.0, 60.0)), 60.0)
    assert wrapping.online_until(55) == 70  # [50, 60) runs on into the next period's [0, 10)
    assert Device(1.0, 1.0, ((0.0, 60.0),), 60.0).online_until(30) == math.inf
    never = Device(1.0, 1.0, (), 60.0)
    assert not never.online(0) and never.next_online(0) == math.inf and never.longest_online() == 0


def test_a_trace_is_read_in_id_order_and_checked(tmp_path) -> None:
    trace = json.loads(Path(_trace(tmp_path, [1.0] * 12)).read_text())
    trace["client_device_capacity"]["10"]["computation"] = 7.0
    devices = fleet_from_trace(trace, 11)
    assert devices[10].seconds_per_sample == pytest.approx(0.021)  # "10" after "9", not after "1"
    with pytest.raises(ValueError, match="fewer than the 13 devices"):
        fleet_from_trace(trace, 13)
    trace["client_behave_trace"]["3"]["inactive"] = [-1]
    with pytest.raises(ValueError, match="client 3"):
        fleet_from_trace(trace, 4)
    (tmp_path / "bad.json").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ValueError, match="not a JSON trace"):
        load_trace(tmp_path / "bad.json")


def test_the_shipped_trace_is_what_its_generator_draws() -> None:
    shipped = load_trace(None)
    assert shipped == json.loads(json.dumps(synthetic_trace(100, 0)))
    assert len(fleet_from_trace(shipped, 100)) == 100


def test_sync_waits_for_the_slowest_device_and_async_lets_the_fast_one_upload_more(tmp_path) -> None:
    """Three devices always online at 1, 5 and 50 ms a sample. A synchronous round lasts the slow device's
    3 x 50 ms x n_slow; asynchronously, in the time the slow device trains twice the fast one uploads many times."""
    trace = _trace(tmp_path, [FAST, MEDIUM, SLOW])
    clocked, history, trainings = _releases(_config(trace, "sync", uploads=6))
    n_slow = clocked.fleet.data.n_train[2]
    assert [m["participants"] for m in history] == [[0, 1, 2], [0, 1, 2]]
    assert [m["time_s"] for m in history] == pytest.approx([0.15 * n_slow, 0.3 * n_slow], abs=TRANSFER)
    assert trainings == [2, 2, 2]

    # asynchronously the fast device trains 5 times per medium training, and the budget of 8 uploads is spent
    # long before the slow device's first upload (3 x 50 ms x n_slow)
    _, history, trainings = _releases(_config(trace, "async", uploads=8, buffer_size=2))
    assert sum(trainings) == history[-1]["uploads"] == 8
    assert trainings[0] >= 3 * trainings[1] >= 3 and trainings[2] == 0, trainings
    assert history[-1]["time_s"] < 0.15 * n_slow
    stale = [s for m in history for s in m["staleness"]]
    assert max(stale) >= 1 and all(0 <= s <= 20 for s in stale)


def test_sync_closes_at_m_updates_or_at_the_deadline(tmp_path) -> None:
    """M = 2 of 3 invited (over-selection 1.5): a round closes at the second arrival, the medium device's
    3 x 5 ms x n; with a deadline shorter than that, at the deadline with the fast device alone."""
    trace = _trace(tmp_path, [FAST, MEDIUM, SLOW])
    clocked, history, _ = _releases(_config(trace, "sync", uploads=2, clients_per_round=2, over_select=1.5))
    n = clocked.fleet.data.n_train
    assert history[0]["participants"] == [0, 1]
    assert history[0]["time_s"] == pytest.approx(0.015 * n[1], abs=TRANSFER)
    deadline = 0.5 * 0.015 * n[1]
    _, history, _ = _releases(_config(trace, "sync", uploads=1, deadline_s=deadline))
    assert history[0]["participants"] == [0] and history[0]["time_s"] == pytest.approx(deadline, abs=TRANSFER)


def test_devices_offline_are_not_invited_and_a_device_leaving_mid_job_drops_out(tmp_path) -> None:
    """Device 1 comes online at 1,000 s only; device 2 leaves after 1 s, before its job ends: the first round
    folds device 0 alone, at device 2's dropout or device 0's upload, whichever is later."""
    trace = _trace(tmp_path, [FAST, FAST, SLOW], spells=[([0], [10**6]), ([1000], [10**6]), ([0], [1])])
    clocked, history, trainings = _releases(_config(trace, "sync", uploads=1))
    assert history[0]["participants"] == [0] and history[0]["dropped"] == 1
    assert history[0]["time_s"] == pytest.approx(max(1.0, 0.003 * clocked.fleet.data.n_train[0]), abs=TRANSFER)
    assert trainings == [1, 0, 0]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, mode: str) -> None:
    trace = _trace(tmp_path, [FAST, MEDIUM, SLOW])
    config = _config(trace, mode, uploads=6, buffer_size=2)
    whole = run_clocked(config, tmp_path / "whole", show_progress=False)
    run_clocked(replace(config, clock=replace(config.clock, uploads=2)), tmp_path / "cut", show_progress=False)
    resumed = run_clocked(config, tmp_path / "cut", resume=True, show_progress=False)

    def lines(run: str) -> list[dict]:
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]

    assert lines("cut") == lines("whole") and len(lines("whole")) >= 2
    assert {k: v for k, v in resumed.items() if k != "wall_s"} == {k: v for k, v in whole.items() if k != "wall_s"}
    state = "state.safetensors"
    assert (tmp_path / "cut" / state).read_bytes() == (tmp_path / "whole" / state).read_bytes()


def test_figure_async_on_digits(tmp_path) -> None:
    """The whole command: three curves, reused on a second call, and a PNG."""
    args = ["figure", "async", "--dataset", "digits", "--clients", "3", "--rounds", "2", "--width", "0.25",
            "--input-size", "16", "--local-epochs", "1", "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9",
            "--scale", "0.5", "--buffer-size", "2", "--trace", _trace(tmp_path, [FAST, MEDIUM, SLOW]),
            "--out", str(tmp_path / "figures")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    # no terminal: a line a release, counted in uploads of the curve's budget
    assert re.search(r"^async fedper: upload \d+/3, mean acc \d\.\d{3} \(", result.output, re.M), result.output
    png = tmp_path / "figures" / "async.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = (tmp_path / "figures" / "async").iterdir()
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in runs}
    assert sorted(summaries) == ["00-sync-fedper", "01-async-fedper", "02-sync-fedavg"]
    for run in (tmp_path / "figures" / "async").iterdir():  # what the figure draws as name and chance line
        info = json.loads((run / "data.json").read_text())
        assert info["name"].startswith("digits") and 0.1 <= info["chance_accuracy"] <= 1
    assert all(s["uploads"] >= 3 for s in summaries.values())  # the budget: 2 rounds x 0.5 x 3 clients
    assert summaries["01-async-fedper"]["time_s"] < summaries["00-sync-fedper"]["time_s"]
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "starts over" not in again.output
    bad = CliRunner().invoke(app, ["figure", "fig2", "--dataset", "digits", "--buffer-size", "2"])
    assert bad.exit_code == 2 and "for figure async only" in bad.output
