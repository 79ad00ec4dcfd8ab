"""The agent's rows for asynchronous rounds (docs/protocol.md 8.2), on its engine alone: hand-built RoundInfo
with max_staleness, model chunks and invitations in (tests/test_edge_engine.py's frames), fake train results,
what it publishes read back by hand. An update trained on a round that was superseded meanwhile still goes,
tagged with its round, unless it is out of the window; the device then trains on the open round when asked;
a carried invitation (still naming its round) leaves it idle; a RoundInfo that comes again resends the saved
update of an earlier round within the window (encoded against that round's model); synchronous rounds do
none of this."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save as st_save
from test_edge_engine import (
    Device,
    Phase,
    TrainRound,
    chunk_frames,
    invitation,
    jobs,
    model,
    published,
    same,
    selecting,
    sent_update,
)

UPDATE = "fedper/v1/lab/update/dev0"


def test_an_update_trained_on_a_superseded_round_goes_tagged_with_it_and_the_device_trains_again() -> None:
    device = Device()
    device.connect()
    (job,) = jobs(device.open_round(1, max_staleness=2))
    assert device.open_round(2, max_staleness=2) == []  # a newer version while training: held
    out = device.trained(job, 0.5)
    _, meta, update = sent_update(out)
    assert meta["round"] == 1 and same(update, {n: x + np.float32(0.5) for n, x in model(1).items()})
    (again,) = jobs(out)  # then the open round: its model is here already
    assert isinstance(again, TrainRound) and again.info.round == 2 and same(dict(again.model), model(2))


def test_an_update_out_of_the_window_is_not_sent() -> None:
    device = Device()
    device.connect()
    (job,) = jobs(device.open_round(1, max_staleness=1))
    device.open_round(3, max_staleness=1)  # takes rounds 2 and 3
    out = device.trained(job)
    assert [m for m in published(out) if m.topic == UPDATE] == []
    assert any("takes updates of rounds 2 on: not sent" in line for line in device.logs)
    assert [j.info.round for j in jobs(out)] == [3]


def test_a_carried_invitation_leaves_the_device_idle_until_it_is_invited_to_a_later_round() -> None:
    device = Device()
    device.connect()
    blob1, blob2, blob3 = (st_save(model(k)) for k in (1, 2, 3))
    device.feed(selecting(blob1, 1, max_staleness=4), invitation(1))
    (job,) = jobs(device.feed(*chunk_frames(blob1, "r1", 1)))
    assert device.feed(selecting(blob2, 2, max_staleness=4)) == []  # its invitation still names round 1
    out = device.trained(job)
    assert sent_update(out)[1]["round"] == 1 and jobs(out) == [] and device.engine.phase is Phase.IDLE
    device.feed(selecting(blob3, 3, max_staleness=4), invitation(3))
    (job,) = jobs(device.feed(*chunk_frames(blob3, "r3", 3)))
    assert job.info.round == 3


def test_roundinfo_again_resends_the_saved_update_of_an_earlier_round_within_the_window() -> None:
    """A coordinator restart re-publishes RoundInfo: the update of round 1, sent while round 2 was open, may be
    lost with it; it goes again (int8-delta encoded against round 1's model, which the device kept), tagged 1."""
    device = Device(compression="int8-delta")
    device.connect()
    blob1, blob2 = st_save(model(1)), st_save(model(2))
    device.feed(selecting(blob1, 1, max_staleness=2), invitation(1))
    (job,) = jobs(device.feed(*chunk_frames(blob1, "r1", 1)))
    device.feed(selecting(blob2, 2, max_staleness=2))
    first_id, meta, first = sent_update(device.trained(job, 0.5))
    out = device.feed(selecting(blob2, 2, max_staleness=2, deadline=2.0e9))  # the same round, again
    again_id, again_meta, again = sent_update(out)
    assert again_meta == meta and again_meta["round"] == 1 and again_id != first_id
    assert again.keys() == first.keys() and all(np.array_equal(again[n], first[n]) for n in first)
    assert jobs(out) == []
    assert device.feed(selecting(st_save(model(5)), 5, max_staleness=2)) == []  # a new round, 1 is out of it


def test_synchronous_rounds_resend_only_the_open_rounds_update() -> None:
    """The same story without max_staleness: the late update goes once (answered late_update), never again."""
    device = Device()
    device.connect()
    blob1, blob2 = st_save(model(1)), st_save(model(2))
    device.feed(selecting(blob1, 1), invitation(1))
    (job,) = jobs(device.feed(*chunk_frames(blob1, "r1", 1)))
    device.feed(selecting(blob2, 2))
    assert sent_update(device.trained(job))[1]["round"] == 1 and device.engine.phase is Phase.IDLE
    assert device.feed(selecting(blob2, 2, deadline=2.0e9)) == []
