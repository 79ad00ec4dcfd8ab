"""The seeded selection rule (fedper/selection.py) and the selection fields on the wire (docs/protocol.md 6.3, 6.8).

Keys are recomputed here with hashlib from the rule as documented, so another implementation (the
emulator's, a phone's) can check itself against the same statement.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_coordinator_live import TOPICS, Device, metrics, run_in_thread, wait_for
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper import selection
from fedper.mqtt import connect_async, make_client, parse_broker_url
from fedper.selection import Ranking, check_seed, invitations, new_seed, select, selection_key
from fedper.wire import Invitation, Register, RoundInfo, Topics, WireError

DEVICES = [f"dev-{i:05d}" for i in range(1000)]


def key_by_hand(seed: int, round_: int, device: str) -> bytes:
    return hashlib.sha256(f"fedper-selection-v1\0{seed}\0{round_}\0{device}".encode()).digest()


def test_a_round_invites_the_smallest_keys_recomputed_by_hand() -> None:
    assert selection_key(7, 3, "dev-00001") == key_by_hand(7, 3, "dev-00001")
    expected = sorted(DEVICES, key=lambda d: key_by_hand(7, 3, d))[:25]
    assert select(DEVICES, 25, seed=7, round_=3) == expected
    assert select(reversed(DEVICES), 25, seed=7, round_=3) == expected  # the candidates' order is irrelevant
    assert select(DEVICES, 25, seed=8, round_=3) != expected and select(DEVICES, 25, seed=7, round_=4) != expected
    assert select(DEVICES[:5], 25, seed=7, round_=3) == sorted(DEVICES[:5], key=lambda d: key_by_hand(7, 3, d))
    assert select(DEVICES, 0, seed=7, round_=3) == []


def test_selection_is_stable_when_devices_join_and_top_ups_follow_the_ranking() -> None:
    before = select(DEVICES, 50, seed=1, round_=2)
    after = select([*DEVICES, "newcomer"], 50, seed=1, round_=2)
    assert len(set(before) - set(after)) <= 1  # the newcomer displaces at most the last one
    first = select(DEVICES, 30, seed=1, round_=2)
    topped = first + select(set(DEVICES) - set(first), 20, seed=1, round_=2)
    assert topped == before  # select 30, then top up 20 == select 50


def test_every_device_is_invited_about_its_share_of_rounds() -> None:
    fleet = DEVICES[:100]
    counts = Counter(d for r in range(1, 1001) for d in select(fleet, 10, seed=0, round_=r))
    assert set(counts) == set(fleet)
    assert min(counts.values()) >= 50 and max(counts.values()) <= 160  # expected 100 each (binomial sd ~9.5)


def test_a_secret_seed_is_drawn_fresh_and_a_chosen_number_is_refused() -> None:
    """Issue 26: with the public default 0 anyone who knows the ids computes every device's rounds."""
    seeds = {new_seed() for _ in range(64)}
    assert len(seeds) == 64 and all(check_seed(seed) == seed for seed in seeds)
    for guessable in (0, 42, 2 ** 63, 2 ** 128, -5, True, 1.5e30, str(2 ** 100)):
        with pytest.raises(ValueError, match="secret"):
            check_seed(guessable)  # type: ignore[arg-type]


def test_with_a_secret_seed_a_round_is_a_uniformly_random_subset() -> None:
    """What PrivacyAccountant(sampling="fixed") assumes: over fresh secret seeds, 2 of 6 devices are each of
    the 15 pairs equally often (3,000 draws: 200 expected, sd ~14)."""
    fleet = DEVICES[:6]
    pairs = Counter(frozenset(select(fleet, 2, seed=new_seed(), round_=1)) for _ in range(3000))
    assert len(pairs) == 15 and all(140 <= n <= 260 for n in pairs.values())


@pytest.mark.parametrize("m, f, expected", [(100, 1.0, 100), (100, 1.1, 110), (100, 1.3, 130), (7, 1.5, 11),
                                             (1, 1.01, 2), (10, 2.0, 20)])
def test_invitations_are_ceil_f_m_of_the_decimal_f(m: int, f: float, expected: int) -> None:
    assert invitations(m, f) == expected


@pytest.mark.parametrize("m, f", [(0, 1.0), (10, 0.9)])
def test_invitations_refuse_fewer_than_m(m: int, f: float) -> None:
    with pytest.raises(ValueError):
        invitations(m, f)


def round_body(**more: object) -> dict[str, object]:
    return {"v": 1, "round": 2, "rounds": 5, "state": "open", "deadline": 100.5, "blob_id": "r2", "size": 10,
            "sha256": "a" * 64, "count": 1, "base_digest": "sha256:x", **more}


def test_round_info_selection_fields_are_optional_and_checked() -> None:
    plain = RoundInfo.decode(json.dumps(round_body()).encode())  # a coordinator without selection
    assert (plain.selection, plain.next_selection_at) == ("all", None)
    assert "selection" not in json.loads(plain.encode()) and "next_selection_at" not in json.loads(plain.encode())
    invited = RoundInfo.decode(json.dumps(round_body(selection="invited", next_selection_at=160.25)).encode())
    assert (invited.selection, invited.next_selection_at) == ("invited", 160.25)
    assert json.loads(invited.encode()) == round_body(selection="invited", next_selection_at=160.25)
    for bad in ({"selection": "some"}, {"selection": 1}, {"next_selection_at": "soon"},
                {"next_selection_at": 10**400}):
        with pytest.raises(WireError) as refused:
            RoundInfo.decode(json.dumps(round_body(**bad)).encode())
        assert refused.value.code == "bad_message"


def test_invitation_is_a_small_message_on_the_devices_own_topic() -> None:
    assert Topics("lab").invite("dev-1") == "fedper/v1/lab/invite/dev-1"
    with pytest.raises(WireError):
        Topics("lab").invite("a/b")
    assert Invitation.decode(b'{"v":1,"round":3,"extra":"ignored"}') == Invitation(3)
    assert json.loads(Invitation(3).encode()) == {"v": 1, "round": 3}
    for bad in (b'{"v":1,"round":0}', b'{"v":1}', b'{"v":2,"round":3}'):
        with pytest.raises(WireError):
            Invitation.decode(bad)


# ---------------------------------------------------------------- through a real Mosquitto


class InvitedDevice(Device):
    """A scripted device that follows section 8.1: it answers a round only once invited to it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.invited: set[int] = set()
        self.pending: dict[int, Any] = {}  # round -> its base, trained on but not sent: not invited (yet)
        self.lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _on_connect(self, client, userdata, flags, reason, props) -> None:  # type: ignore[no-untyped-def]
        super()._on_connect(client, userdata, flags, reason, props)
        client.subscribe(TOPICS.invite(self.name), 1)

    def _on_message(self, client, userdata, msg) -> None:  # type: ignore[no-untyped-def]
        if msg.topic != TOPICS.invite(self.name):
            super()._on_message(client, userdata, msg)
        elif msg.payload:  # empty: an invitation cleared
            round_ = Invitation.decode(msg.payload).round
            with self.lock:
                self.invited.add(round_)
                base = self.pending.pop(round_, None)
            if base is not None:
                super().send(round_, base)

    def send(self, round_: int, base: Any, **meta: Any) -> None:
        with self.lock:
            if round_ not in self.invited:
                self.pending[round_] = base
                return
        super().send(round_, base, **meta)


class EagerDevice(Device):
    """An agent that ignores selection and trains every round; it never says it is online, so it is never
    invited."""

    def _on_connect(self, client, userdata, flags, reason, props) -> None:  # type: ignore[no-untyped-def]
        client.subscribe([(TOPICS.round, 1), (f"{TOPICS.base}/model/#", 1), (TOPICS.error(self.name), 1)])
        client.publish(TOPICS.register(self.name), Register(self.n, self.manifest.base_digest, "old/1").encode(),
                       qos=1, retain=True)


@pytest.mark.mosquitto
def test_a_live_coordinator_invites_over_mosquitto_and_clears_its_invitations(mosquitto, tmp_path: Path) -> None:
    manifest = tiny_manifest()
    thread, coordinator = run_in_thread(mosquitto.url, tmp_path, manifest, tiny_tensors(), rounds=3, min_clients=2,
                                        round_timeout=30.0, clients_per_round=2, over_select=1.5)
    devices = [InvitedDevice(mosquitto.url, f"d{i}", 10, 0.1 * i, manifest) for i in range(5)]
    eager = EagerDevice(mosquitto.url, "eager", 10, 1.0, manifest)
    thread.join(60)
    assert not thread.is_alive() and coordinator.finished
    records = metrics(tmp_path)
    assert [r["round"] for r in records] == [1, 2, 3] and all(r["participants"] == 2 for r in records)
    assert all(2 <= r["invited"] <= 3 for r in records) and records[-1]["invited"] == 3  # all 5 online by then
    for record in records:  # closed at M = 2: long before the deadline, the third invitee's update comes late
        assert record["collect_s"] < 20
        for name in record["devices"]:
            assert record["round"] in next(d for d in devices if d.name == name).invited
    assert "eager" not in {name for r in records for name in r["devices"]}
    wait_for(lambda: bool(eager.errors), 5, "the eager device's refusal")
    assert "not_invited" in {e.code for e in eager.errors} <= {"not_invited", "late_update"}  # late: after a close
    assert {e.code for d in devices for e in d.errors} <= {"late_update"}  # over-selected, answered after M
    retained: list[str] = []
    watcher = make_client("watcher")
    watcher.on_connect = lambda client, *rest: client.subscribe(f"{TOPICS.base}/invite/#", 1)
    watcher.on_message = lambda client, userdata, msg: retained.append(msg.topic)
    connect_async(watcher, parse_broker_url(mosquitto.url))
    time.sleep(1.0)
    assert retained == []  # every invitation was cleared when its round closed
    for client in [watcher, *(d.client for d in [*devices, eager])]:
        client.disconnect()
        client.loop_stop()


def test_a_kept_ranking_takes_what_select_takes_as_candidates_come_and_go() -> None:
    """Within a round (cleared and offered every candidate at its opening, then told of each device that
    comes online) Ranking.take is select() over the candidates of the moment, whatever came online, went
    offline or was invited in between."""
    rng = random.Random(7)
    seed = new_seed()
    ranking = Ranking(seed)
    fleet = [f"dev-{i}" for i in range(300)]
    for round_ in range(1, 6):
        ranking.clear()
        online, invited = set(rng.sample(fleet, 150)), set()
        ranking.offer(online, round_)
        for _ in range(20):
            flipped = set(rng.sample(fleet, 20))  # some come online, some go
            ranking.offer(flipped - online, round_)
            online ^= flipped
            candidates = online - invited
            k = rng.randint(0, 12)
            expected = select(candidates, k, seed=seed, round_=round_)
            assert ranking.take(k, candidates.__contains__) == expected
            invited |= set(expected)


def test_a_kept_ranking_draws_keys_only_for_devices_offered_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost that made a selecting coordinator's work grow with the fleet: select() drew a key for each of
    20,000 candidates at every top-up, and finding the candidates new to a kept ranking was still a pass
    over them all; the ranking told of changes draws one key per device offered and looks at no other."""
    drawn, asked = [], []
    real = selection.selection_key
    monkeypatch.setattr(selection, "selection_key", lambda *args: drawn.append(args) or real(*args))
    candidates = {f"dev-{i}" for i in range(20_000)}
    ranking = Ranking(new_seed())
    ranking.offer(candidates, 1)
    first = ranking.take(10, candidates.__contains__)
    assert len(drawn) == 20_000 and len(first) == 10
    drawn.clear()
    candidates = candidates - set(first) | {"late-1", "late-2"}
    ranking.offer(["late-1", "late-2", next(iter(candidates))], 2)  # one already ranked keeps its key
    later = ranking.take(10, lambda device: asked.append(device) or device in candidates)
    assert len(drawn) == 2 and not set(later) & set(first) and len(asked) < 100  # the two newcomers only
    drawn.clear()
    ranking.offer(first + later, 3)  # the twenty taken are candidates again: they enter anew, with round 3's key
    assert sorted(args[2] for args in drawn) == sorted(first + later) and {args[1] for args in drawn} == {3}


def test_a_device_popped_while_not_a_candidate_comes_back_only_when_offered() -> None:
    """take drops what is no longer a candidate (offline, invited, sitting out); the coordinator offers it
    again when that ends, and only then can it be taken."""
    ranking = Ranking(new_seed())
    ranking.offer(["a", "b", "c"], 1)
    assert sorted(ranking.take(3, {"a", "b"}.__contains__)) == ["a", "b"]  # c was offline: dropped
    assert ranking.take(3, {"c"}.__contains__) == []
    ranking.offer(["c"], 2)  # c came online again
    assert ranking.take(3, {"c"}.__contains__) == ["c"]
