"""SecAgg+ (fedper.secagg): the sum is exact up to the documented quantization, dropouts before and after
masking are recovered, adverts are checked against the fleet's root, a coordinator that lies about the
survivors cannot unmask a device (the consistency check), a device whose shares do not authenticate is
excluded without costing the session, groups are summed apart, fewer than t Shamir shares give nothing,
and a device's traffic grows with k in the sharing stages and with n in the consistency check only.

The kernel speaks fedper.wire's stage messages; in a full session every message crosses the serialization boundary
(its JSON, safetensors for the masked vector), as it would through the coordinator."""

from __future__ import annotations

import base64
import json
import math
import secrets
from dataclasses import replace
from functools import cache

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.secagg import (
    NONCE_BYTES,
    PRIME,
    SHARE_PLAINTEXT_BYTES,
    TAG_BYTES,
    DeviceKeys,
    IdentityError,
    MaskedInput,
    NotEnoughShares,
    SecAggClient,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    UnmaskRefused,
    advert_problem,
    degree_for,
    quantization_scale,
    quantize,
    reconstruct,
    shamir_combine,
    shamir_split,
    survivors_message,
)
from fedper.secagg import Identity as DeviceIdentity
from fedper.wire import (
    KEY_BYTES,
    SEALED_SHARE_BYTES,
    SHARE_BYTES,
    SIGNATURE_BYTES,
    SIGNER_BYTES,
    SecAggAdvertise,
    SecAggMask,
    SecAggReceived,
    SecAggShares,
    SecAggSignature,
    SecAggSurvivors,
    SecAggUnmask,
    SecAggUnmaskRequest,
    WireError,
)

ROOT = Ed25519PrivateKey.generate()  # the fleet's root: the operator's, never the coordinator's
FLEET = "lab"


@cache
def identity(name: str) -> DeviceIdentity:
    return DeviceIdentity.issue(ROOT, FLEET, name)


def names(devices: int) -> tuple[str, ...]:
    return tuple(f"d{i:03d}" for i in range(devices))


def make_config(session: int, devices: int, length: int, clip: float, **options: object) -> SecAggConfig:
    return SecAggConfig.create(1, session, names(devices), length, clip, **options)  # type: ignore[arg-type]


def clients_for(config: SecAggConfig) -> list[SecAggClient]:
    return [SecAggClient(config, u, identity(config.roster[u])) for u in range(config.devices)]


def server_for(config: SecAggConfig) -> SecAggServer:
    return SecAggServer(config, FLEET, ROOT.public_key())


def through_wire(message, traffic: dict[tuple[int, str], int], device: int):
    """The message as the other side decodes it from the bytes MQTT would carry (its JSON, or the masked input's
    safetensors); its bytes counted against (`device`, the message's kind)."""
    if isinstance(message, MaskedInput):
        payload = message.to_safetensors()
        decoded = MaskedInput.from_safetensors(payload)
    else:
        payload = message.encode()
        decoded = type(message).decode(payload)
    key = (device, type(message).__name__)
    traffic[key] = traffic.get(key, 0) + len(payload)
    return decoded


def run_round(config: SecAggConfig, vectors: np.ndarray, *, gone_before_keys=(), gone_before_shares=(),
              gone_before_input=(), gone_before_signature=(), gone_before_unmask=(), rng=None):
    """One session over all devices; a device in a `gone_before_*` set vanishes before sending that stage's
    message (gone_before_unmask: it signed the survivors, then went silent). Returns the server's result and
    each device's bytes by message kind (up and down, the masked vector included)."""
    clients, server = clients_for(config), server_for(config)
    traffic: dict[tuple[int, str], int] = {}

    def wire(message, device: int):
        return through_wire(message, traffic, device)

    keys = server.neighbour_keys({c.device: wire(c.advertise(), c.device) for c in clients
                                  if c.device not in gone_before_keys})
    inbox = server.relay_shares({u: wire(clients[u].share_keys(wire(m, u)), u) for u, m in keys.items()
                                 if u not in gone_before_shares})
    requests = server.mask_requests({u: wire(clients[u].receive_shares(wire(m, u)), u) for u, m in inbox.items()})
    lists = server.survivor_lists([wire(clients[u].masked_input(wire(m, u), vectors[u], rng), u)
                                   for u, m in requests.items() if u not in gone_before_input])
    unmask = server.unmask_requests({u: wire(clients[u].sign_survivors(wire(m, u)), u) for u, m in lists.items()
                                     if u not in gone_before_signature})
    responses = {u: wire(clients[u].unmask(wire(m, u)), u) for u, m in unmask.items() if u not in gone_before_unmask}
    return server.aggregate(responses), traffic


def only_sum(result) -> np.ndarray:
    """The sum of a one-group session (its group reconstructed)."""
    (group,) = result.groups
    assert not group.failure, group.failure
    return group.sum


def quantization_bound(config: SecAggConfig, count: int, stochastic: bool = False) -> float:
    """The largest error per coordinate of the sum of `count` devices: half a step each (nearest), or a step."""
    step = 1 / quantization_scale(config.clip, config.value_bits)
    return count * step * (1.0 if stochastic else 0.5) + 1e-9


def test_sum_equals_numpy_sum_up_to_quantization() -> None:
    config = make_config(3, 10, 500, 1.0)
    vectors = np.random.default_rng(0).uniform(-1, 1, (10, 500))
    result, _ = run_round(config, vectors)
    assert result.survivors == tuple(range(10))
    error = np.abs(only_sum(result) - vectors.sum(axis=0)).max()
    assert error <= quantization_bound(config, 10)
    assert error > 0  # quantization is real; the test would notice an exact-float shortcut

    stochastic, _ = run_round(config, vectors, rng=np.random.default_rng(1))
    assert np.abs(only_sum(stochastic) - vectors.sum(axis=0)).max() <= quantization_bound(config, 10, stochastic=True)


def test_values_are_clipped_before_quantization_and_nan_stays_on_the_device() -> None:
    config = make_config(1, 4, 3, 0.5)
    vectors = np.array([[2.0, -3.0, 0.1]] * 4)
    result, _ = run_round(config, vectors)
    np.testing.assert_allclose(only_sum(result), [2.0, -2.0, 0.4], atol=quantization_bound(config, 4))
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.array([0.0, np.nan]), 1.0, 20)


def keeps_threshold(config: SecAggConfig, sharers: set[int], answering: set[int]) -> bool:
    """The documented condition for a round to close: every contributor and every device that dropped
    after sharing keeps t neighbours that answer stage 6."""
    return all(len(answering & set(config.neighbours(u))) >= config.threshold for u in sharers)


@pytest.mark.parametrize(("degree", "majority"), [(29, True), (None, False)],
                         ids=["complete-graph-majority-t", "sparse-graph-third-t"])
def test_thirty_percent_vanishing_after_masking_and_some_before_still_give_the_right_sum(degree, majority) -> None:
    """1 device gone before stage 1, 1 before 2, 1 before its masked input, and 9 (30 %) after signing the
    survivors. With the majority threshold that needs about the complete graph at n = 30; the sparse default
    graph (k = 16) tolerates it with t = k/3 + 1, the semi-honest setting (docs/privacy.md)."""
    probe = make_config(7, 30, 64, 1.0, degree=degree, graph_seed=11)
    config = probe if majority else replace(probe, threshold=probe.degree // 3 + 1)
    assert (config.degree == 29) == majority
    vectors = np.random.default_rng(2).uniform(-1, 1, (30, 64))
    for seed in range(20):  # the first random pattern the graph tolerates (most do)
        order = np.random.default_rng(seed).permutation(30).tolist()
        if keeps_threshold(config, sharers=set(order[2:]), answering=set(order[12:])):
            break
    else:
        pytest.fail("no tolerated dropout pattern in 20 seeds")
    result, _ = run_round(config, vectors, gone_before_keys={order[0]}, gone_before_shares={order[1]},
                          gone_before_input={order[2]}, gone_before_unmask=set(order[3:12]))
    contributed = sorted(order[3:])
    assert result.survivors == tuple(contributed) and len(contributed) == 27
    error = np.abs(only_sum(result) - vectors[contributed].sum(axis=0)).max()
    assert error <= quantization_bound(config, len(contributed))


def test_degree_for_a_dropout_rate_grows_with_log_n_and_a_round_at_it_closes() -> None:
    assert degree_for(100, 0.3) == 99  # heavy dropout at a small fleet: the complete graph
    heavy = [degree_for(n, 0.3) for n in (1_000, 10_000, 100_000)]
    assert heavy == sorted(heavy) and heavy[-1] < 1.5 * heavy[0]  # a hundred times the devices, +40 % in k
    assert degree_for(50, 0.1) == 20 and degree_for(50, 0.1, failure=0.1) < 20

    config = make_config(1, 50, 32, 1.0, degree=degree_for(50, 0.1), graph_seed=4)
    vectors = np.random.default_rng(6).uniform(-1, 1, (50, 32))
    rng = np.random.default_rng(7)
    silent = {u for u in range(50) if rng.random() < 0.1}  # each device silent in stage 6 with probability 0.1
    result, _ = run_round(config, vectors, gone_before_unmask=silent)
    assert result.survivors == tuple(range(50)) and silent
    assert np.abs(only_sum(result) - vectors.sum(axis=0)).max() <= quantization_bound(config, 50)


def test_too_many_dropouts_give_no_sum_rather_than_a_wrong_one() -> None:
    config = make_config(1, 12, 8, 1.0, degree=6)
    gone = set(range(1, 12, 2)) | {2}  # 7 of 12 never answer stage 6: some neighbourhood keeps < t = 4
    result, _ = run_round(config, np.zeros((12, 8)), gone_before_unmask=gone)
    (group,) = result.groups
    assert group.sum is None and "shares" in group.failure and not group.lied

    with pytest.raises(SecAggError, match="the consistency check needs 7"):  # 6 inputs of 12: no majority
        run_round(config, np.zeros((12, 8)), gone_before_input=set(range(6)))


def to_stage(config: SecAggConfig, stage: str, vectors: np.ndarray | None = None):
    """Clients and server run honestly up to `stage` ("reports", "masked" or "signed"); returns them and the
    server's last messages."""
    vectors = np.zeros((config.devices, config.length)) if vectors is None else vectors
    clients, server = clients_for(config), server_for(config)
    keys = server.neighbour_keys({c.device: c.advertise() for c in clients})
    inbox = server.relay_shares({u: clients[u].share_keys(m) for u, m in keys.items()})
    if stage == "reports":
        return clients, server, inbox
    requests = server.mask_requests({u: clients[u].receive_shares(m) for u, m in inbox.items()})
    masked = {u: clients[u].masked_input(m, vectors[u]) for u, m in requests.items()}
    if stage == "masked":
        return clients, server, masked
    lists = server.survivor_lists(masked.values())
    return clients, server, server.unmask_requests({u: clients[u].sign_survivors(m) for u, m in lists.items()})


def test_a_coordinator_that_lies_about_the_survivors_cannot_unmask_a_device() -> None:
    """The attack of issue 26, which reads device 0's vector to 1e-9 with the kernel before the consistency check:
    the coordinator holds every masked input, then tells device 0's neighbours different survivor sets so that
    together they reveal 0's self-mask seed and every neighbour's mask key. Under the check each device signs one
    set and answers only with more than half of the session's signatures on it: {0, v} alone is not signed; the
    split {0, 1, 2} / {0, 3, 4} gets 0's signature on one side only, so 3 and 4 refuse, as they do when shown 1's
    and 2's signatures on the other set, or signatures under identity keys the fleet's root did not certify; what
    1 and 2 reveal rebuilds neither secret. The same devices answer the honest request, whose sum is right."""
    config = make_config(4, 5, 64, 1.0)  # the complete graph: k = 4, t = 3, 3 signatures needed
    vectors = np.random.default_rng(8).uniform(-1, 1, (5, 64))
    clients, _, _ = to_stage(config, "masked", vectors)
    with pytest.raises(SecAggError, match="needs 3 to sign"):
        clients[1].sign_survivors(SecAggSurvivors(config.round, config.session, [0, 1]))

    clients, _, _ = to_stage(config, "masked", vectors)  # afresh: each device signs one set a session
    told = {0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2), 3: (0, 3, 4), 4: (0, 3, 4)}
    signed = {u: clients[u].sign_survivors(SecAggSurvivors(config.round, config.session, list(told[u])))
              for u in range(5)}

    def signer(u: int, signature: bytes | None = None, who: DeviceIdentity | None = None) -> bytes:
        who = who or identity(config.roster[u])
        return who.certificate.public + who.certificate.signature + (signature or signed[u].signature)

    def request(signers: dict[int, bytes]) -> SecAggUnmaskRequest:
        return SecAggUnmaskRequest(config.round, config.session, signers)

    answers = {u: clients[u].unmask(request({v: signer(v) for v in (0, 1, 2)})) for u in (1, 2)}
    for u in (3, 4):
        for signers in ((0, 3, 4), (1, 2, 3, 4)):
            with pytest.raises(UnmaskRefused, match="2 valid signatures"):
                clients[u].unmask(request({v: signer(v) for v in signers}))
        impostor = DeviceIdentity.issue(Ed25519PrivateKey.generate(), FLEET, config.roster[0])  # not the fleet's root
        forged = impostor.sign(survivors_message(config.digest, (0, 3, 4)))
        with pytest.raises(UnmaskRefused):
            clients[u].unmask(request({0: signer(0, forged, impostor), 3: signer(3), 4: signer(4)}))
    seed_of_0 = {v + 1: int.from_bytes(a.seed_shares[0], "big") for v, a in answers.items()}
    key_of_3 = {v + 1: int.from_bytes(a.key_shares[3], "big") for v, a in answers.items()}
    assert len(seed_of_0) == len(key_of_3) == 2 < config.threshold
    for shares in (seed_of_0, key_of_3):
        with pytest.raises(NotEnoughShares):
            reconstruct(shares, config.threshold, 0, "any")

    clients, server, requests = to_stage(config, "signed", vectors)  # the honest coordinator
    result = server.aggregate({u: clients[u].unmask(m) for u, m in requests.items()})
    assert np.abs(only_sum(result) - vectors.sum(axis=0)).max() <= quantization_bound(config, 5)
    with pytest.raises(UnmaskRefused, match="already"):  # answered once: a second request gets nothing
        clients[0].unmask(requests[0])


def packed(advert: SecAggAdvertise) -> bytes:
    """An advert as a setup relays it (docs/protocol.md, 6.9): c_public || s_public || identity || certificate ||
    signature."""
    return advert.c_public + advert.s_public + advert.identity + advert.certificate + advert.signature


def test_adverts_are_checked_against_the_fleet_root_by_the_server_and_the_neighbours() -> None:
    """A key substituted in transit, an identity certified by another root, another device's certificate, or an
    advert of another session: the server refuses it, and so does a device it is relayed to."""
    config = make_config(6, 4, 4, 1.0)
    clients = clients_for(config)
    honest = {c.device: c.advertise() for c in clients}
    setup = server_for(config).neighbour_keys(honest)[0]
    stranger = DeviceIdentity.issue(Ed25519PrivateKey.generate(), FLEET, config.roster[1])
    forgeries = {
        "substituted key": replace(honest[1], c_public=DeviceKeys.generate().public()[0]),
        "another root": DeviceKeys.generate().advert(stranger, config.round, config.session),
        "another device's certificate": replace(honest[1], identity=honest[2].identity,
                                                certificate=honest[2].certificate),
        "another session": replace(DeviceKeys.generate().advert(identity(config.roster[1]), config.round,
                                                                config.session + 1), session=config.session),
    }
    for what, forged in forgeries.items():
        assert advert_problem(forged, config.roster[1], FLEET, ROOT.public_key()), what
        with pytest.raises(IdentityError):
            server_for(config).neighbour_keys({**honest, 1: forged})
        device = clients_for(config)[0]
        device.advertise()
        with pytest.raises(IdentityError):
            device.share_keys(replace(setup, adverts={**setup.adverts, 1: packed(forged)}))
    assert all(advert_problem(a, config.roster[u], FLEET, ROOT.public_key()) == "" for u, a in honest.items())
    with pytest.raises(ValueError, match="gives index 1"):  # a device only takes the index of its own name
        SecAggClient(config, 1, identity(config.roster[2]))
    for unlike in (replace(setup, index=1), replace(setup, threshold=3), replace(setup, graph_seed=1)):
        device = clients_for(config)[0]  # a setup other than the one the device runs: another index, t, graph
        device.advertise()
        with pytest.raises(SecAggError, match="unlike"):
            device.share_keys(unlike)


def test_a_device_whose_shares_do_not_authenticate_is_excluded_and_the_others_still_sum() -> None:
    """Device 3 sends garbage ciphertexts to every neighbour (and device 0 gets one share relabelled by the
    relay): each receiver reports the sender, the server excludes the reported devices, nobody masks with them,
    and the sum of the others is right. A report that would leave its sender fewer than t shares is refused."""
    config = make_config(2, 6, 16, 1.0)  # complete graph: k = 5, t = 3
    vectors = np.random.default_rng(4).uniform(-1, 1, (6, 16))
    clients, server = clients_for(config), server_for(config)
    keys = server.neighbour_keys({c.device: c.advertise() for c in clients})
    bundles = {u: clients[u].share_keys(m) for u, m in keys.items()}
    bundles[3] = replace(bundles[3], shares={v: s[:NONCE_BYTES] + secrets.token_bytes(len(s) - NONCE_BYTES)
                                             for v, s in bundles[3].shares.items()})
    inbox = server.relay_shares(bundles)
    inbox[0] = replace(inbox[0], shares={**inbox[0].shares, 4: inbox[0].shares[5]})  # 5's share to 0, as 4's
    reports = {u: clients[u].receive_shares(m) for u, m in inbox.items()}
    assert reports[0].skipped == [3, 4] and all(reports[u].skipped == [3] for u in (1, 2, 4, 5))
    assert reports[3].skipped == []
    with pytest.raises(SecAggError, match="fewer than t"):
        server.check_report(1, SecAggReceived(config.round, config.session, [0, 2, 3]))
    requests = server.mask_requests(reports)
    assert server.excluded == (3, 4) and sorted(requests) == [0, 1, 2, 5]
    assert requests[0].excluded == [3, 4]
    lists = server.survivor_lists(clients[u].masked_input(m, vectors[u]) for u, m in requests.items())
    unmask = server.unmask_requests({u: clients[u].sign_survivors(m) for u, m in lists.items()})
    result = server.aggregate({u: clients[u].unmask(m) for u, m in unmask.items()})
    kept = [0, 1, 2, 5]
    assert result.survivors == tuple(kept)
    assert np.abs(only_sum(result) - vectors[kept].sum(axis=0)).max() <= quantization_bound(config, 4)


def test_groups_are_summed_apart_and_a_lie_spoils_only_its_own_group() -> None:
    """Two groups of 4 and 5 devices: each group's sum is its devices' sum; the graph has no edge across groups.
    When device 6 answers with a wrong self-mask share of a neighbour, that group's secret does not check out or
    its sum is garbage, and the other group's sum is still right."""
    config = make_config(3, 9, 32, 1.0, groups=(4, 5))
    assert all(config.group(v) == config.group(u) for u in range(9) for v in config.neighbours(u))
    assert [config.group_threshold(g) for g in (0, 1)] == [2, 3]  # a majority of 3 and of 4 neighbours
    vectors = np.random.default_rng(5).uniform(-1, 1, (9, 32))
    result, _ = run_round(config, vectors)
    for group, members in zip(result.groups, ([0, 1, 2, 3], [4, 5, 6, 7, 8]), strict=True):
        assert group.survivors == tuple(members)
        assert np.abs(group.sum - vectors[members].sum(axis=0)).max() <= quantization_bound(config, len(members))

    clients, server, requests = to_stage(config, "signed", vectors)
    responses = {u: clients[u].unmask(m) for u, m in requests.items()}
    liar = responses[6]
    victim = min(liar.seed_shares)
    responses[6] = replace(liar, seed_shares={**liar.seed_shares, victim: b"\x01" * SHARE_BYTES})
    first, second = server.aggregate(responses).groups
    assert np.abs(first.sum - vectors[:4].sum(axis=0)).max() <= quantization_bound(config, 4)
    assert second.lied or np.abs(second.sum - vectors[4:].sum(axis=0)).max() > 1.0


def test_fewer_than_t_shamir_shares_reveal_nothing() -> None:
    secret = secrets.randbelow(2**256)
    shares = shamir_split(secret, threshold=4, xs=range(1, 8))
    assert shamir_combine({x: shares[x] for x in (2, 3, 5, 7)}) == secret
    assert shamir_combine(shares) == secret
    three = {x: shares[x] for x in (1, 4, 6)}
    assert shamir_combine(three) != secret
    with pytest.raises(NotEnoughShares):
        reconstruct(three, threshold=4, device=0, kind="self-mask")
    # one share of a fresh sharing is uniform: across sharings of the same secret it never repeats
    assert len({shamir_split(5, 2, [1, 2])[1] for _ in range(50)}) == 50


def test_masked_input_hides_the_vector_and_stages_run_once() -> None:
    config = make_config(9, 3, 20_000, 1.0)
    clients, _, masked = to_stage(config, "masked")
    with pytest.raises(SecAggError):  # a second masked input under the same masks would leak a difference
        clients[0].masked_input(SecAggMask(config.round, config.session, []), np.ones(20_000))
    with pytest.raises(SecAggError):  # an unmask request before the device signed the survivors
        clients[0].unmask(SecAggUnmaskRequest(config.round, config.session, {}))
    zero = quantize(np.zeros(20_000), config.clip, config.value_bits)
    assert (masked[0].masked != zero).mean() > 0.99
    assert abs(masked[0].masked.astype(np.float64).mean() / 2**32 - 0.5) < 0.01  # uniform over the whole field


def test_the_server_refuses_inputs_outside_the_protocol() -> None:
    config = make_config(2, 4, 4, 1.0)
    clients, server = clients_for(config), server_for(config)
    keys = server.neighbour_keys({c.device: c.advertise() for c in clients if c.device != 3})
    inbox = server.relay_shares({u: clients[u].share_keys(m) for u, m in keys.items()})
    requests = server.mask_requests({u: clients[u].receive_shares(m) for u, m in inbox.items()})
    stranger = MaskedInput(config.session, 3, np.zeros(4, dtype=np.uint32))  # never shared its keys
    with pytest.raises(SecAggError, match="device 3"):
        server.survivor_lists([clients[0].masked_input(requests[0], np.zeros(4)), stranger])
    fresh = clients_for(config)
    with pytest.raises(SecAggError, match="session 1"):  # an advert of another session
        server_for(config).neighbour_keys({0: fresh[0].advertise(), 1: replace(fresh[1].advertise(), session=1)})


def test_messages_round_trip_and_the_setup_is_the_servers() -> None:
    """Every stage message comes back equal through the wire's JSON (bytes as base64, indices as object keys), and
    a device decodes from its setup the server's configuration and the vector's options."""
    share, sealed = b"s" * SHARE_BYTES, b"c" * SEALED_SHARE_BYTES
    for message in (SecAggAdvertise(1, 5, b"\x01" * 32, b"\x02" * 32, b"\x03" * 32, b"\x04" * 64, b"\x05" * 64),
                    SecAggShares(1, 5, {2: sealed, 0: sealed}), SecAggReceived(1, 5, [2, 7]), SecAggMask(1, 5, [7]),
                    SecAggSurvivors(1, 5, list(range(40))), SecAggSignature(1, 5, b"g" * 64),
                    SecAggUnmaskRequest(1, 5, {3: b"i" * SIGNER_BYTES}), SecAggUnmask(1, 5, {2: share}, {4: share})):
        assert through_wire(message, {}, 0) == message
    masked = MaskedInput(1, 2, np.arange(10, dtype=np.uint32))
    decoded = MaskedInput.from_safetensors(masked.to_safetensors())
    assert (decoded.session, decoded.device) == (1, 2) and np.array_equal(decoded.masked, masked.masked)
    with pytest.raises(SecAggError):
        MaskedInput.from_safetensors(b"\x00" * 16)

    config = make_config(5, 50, 7, 0.25, graph_seed=3, groups=(20, 30))
    adverts = {c.device: c.advertise() for c in clients_for(config)}
    setups = server_for(config).neighbour_keys(adverts, 40, clip_norm=0.2, noise_std=0.01, weights="uniform",
                                               tensors="trainable")
    setup = through_wire(setups[0], {}, 0)
    assert setup == setups[0] and SecAggConfig.of(setup) == config and SecAggConfig.of(setup).digest == config.digest
    assert (setup.weight_scale, setup.clip_norm, setup.noise_std, setup.weights, setup.tensors) == (
        40, 0.2, 0.01, "uniform", "trainable")
    assert {v: packed(adverts[v]) for v in config.neighbours(0)} == setup.adverts
    assert replace(config, roster=(*config.roster[:-1], "other")).digest != config.digest  # the roster is bound


def test_the_wire_sizes_are_the_kernel_byte_sizes_and_other_sizes_are_refused() -> None:
    """fedper.wire's byte sizes are those of the kernel's primitives; a stage message, written by hand, whose
    base64 holds another number of bytes, or is not base64, is refused before the kernel sees it."""
    assert (PRIME.bit_length() + 7) // 8 == SHARE_BYTES
    assert SEALED_SHARE_BYTES == NONCE_BYTES + SHARE_PLAINTEXT_BYTES + TAG_BYTES
    assert {len(k) for k in DeviceKeys.generate().public()} == {len(identity("d000").certificate.public)} == {KEY_BYTES}
    assert len(identity("d000").sign(b"x")) == SIGNATURE_BYTES
    short = base64.b64encode(b"x" * (SEALED_SHARE_BYTES - 1)).decode()
    advert = {"stage": "advertise", "c_public": short[:44], "s_public": short[:44], "identity": short[:44],
              "certificate": short[:88], "signature": short[:88]}
    for kind, body in ((SecAggShares, {"stage": "shares", "shares": {"0": short}}),
                       (SecAggAdvertise, advert),  # 44 characters without padding: 33 bytes
                       (SecAggAdvertise, {**advert, "c_public": "!" * 43 + "="}),
                       (SecAggUnmask, {"stage": "unmask", "seed_shares": {"0": "AAAA"}, "key_shares": {}}),
                       (SecAggUnmaskRequest, {"stage": "unmask", "signatures": {"0": short[:216]}}),
                       (SecAggSignature, {"stage": "consistency", "signature": "AAAA"})):
        with pytest.raises(WireError) as e:
            kind.decode(json.dumps({"v": 1, "round": 1, "session": 1, **body}).encode())
        assert e.value.code == "bad_message" and "bytes" in str(e.value)


def test_the_summed_tensors_are_one_manifest_method() -> None:
    """Secure aggregation, distributed DP and central DP sum the same tensors: every shared one, or the
    trainable shared ones (BatchNorm statistics are not gradients)."""
    info = ModelInfo("t", kp=1, num_classes=2, input_shape=(1, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    manifest = Manifest(info, "fedper", (TensorSpec("w", (2,), "float32", "base", True, True),
                                         TensorSpec("bn.running_mean", (2,), "float32", "base", False, True),
                                         TensorSpec("head", (2,), "float32", "head", True, False)))
    assert [t.name for t in manifest.summed_tensors()] == ["w", "bn.running_mean"]
    assert [t.name for t in manifest.summed_tensors("trainable")] == ["w"]
    with pytest.raises(ValueError, match="summed tensors"):
        manifest.summed_tensors("head")  # type: ignore[arg-type]


def test_the_graph_is_k_regular_and_symmetric() -> None:
    for devices in (10, 50, 100):
        config = make_config(1, devices, 1, 1.0, graph_seed=devices)
        assert config.degree == min(devices - 1, 2 * math.ceil(1.5 * math.log2(devices)))
        for u in range(devices):
            assert len(config.neighbours(u)) == config.degree and u not in config.neighbours(u)
            assert all(u in config.neighbours(v) for v in config.neighbours(u))
    with pytest.raises(ValueError, match="groups"):
        make_config(1, 5, 1, 1.0, groups=(4, 1))


def per_device_bytes(devices: int, degree: int | None) -> tuple[int, float, float]:
    """The degree, and the mean bytes per device (up and down) of a session with a 16-value vector: in the
    sharing stages, and in the setup (it names the roster) and the consistency check (the survivor set, the
    signature, the unmask request's signatures)."""
    config = make_config(1, devices, 16, 1.0, degree=degree, graph_seed=devices)
    _, traffic = run_round(config, np.zeros((devices, 16)))
    check = ("SecAggNeighbours", "SecAggSurvivors", "SecAggSignature", "SecAggUnmaskRequest")
    consistency = sum(b for (_, kind), b in traffic.items() if kind in check)
    return config.degree, (sum(traffic.values()) - consistency) / devices, consistency / devices


def test_per_device_cost_grows_with_k_in_the_sharing_stages_and_with_n_in_the_consistency_check() -> None:
    fixed = [per_device_bytes(n, degree=8) for n in (10, 50, 100)]
    sharing = [f[1] for f in fixed]
    assert max(sharing) / min(sharing) < 1.05  # same k, ten times the devices: the same sharing traffic
    k10, sharing10, check10 = per_device_bytes(10, degree=None)
    k100, sharing100, check100 = per_device_bytes(100, degree=None)
    assert (k10, k100) == (9, 20)
    assert sharing100 / sharing10 < 1.3 * k100 / k10 < 100 / 10  # proportional to k, far below n's growth
    # each device gets the signatures of n // 2 + 1 devices (216 base64 characters each), the survivor set and
    # the roster (up to 4 and 7 characters a device here), and its k neighbours' adverts (300 characters each)
    assert 216 * 51 < check100 < 216 * 51 + 11 * 100 + 300 * k100 + 1000 and check100 / check10 > 4


def test_a_100k_vector_sums_exactly_up_to_quantization() -> None:
    config = make_config(1, 5, 100_000, 0.1, degree=4)
    vectors = np.random.default_rng(3).normal(0, 0.03, (5, 100_000))
    result, traffic = run_round(config, vectors, gone_before_unmask={4})
    clipped = np.clip(vectors, -0.1, 0.1).sum(axis=0)
    assert np.abs(only_sum(result) - clipped).max() <= quantization_bound(config, 5)
    per_device: dict[int, int] = {}
    for (device, _), size in traffic.items():
        per_device[device] = per_device.get(device, 0) + size
    assert all(4 * 100_000 < b < 4 * 100_000 + 6144 for b in per_device.values())  # fp32-sized plus a few KiB


def test_the_vectors_signatures_verify_over_the_documented_bytes() -> None:
    """docs/protocol.md, 6.9's byte layouts, written out here with struct and the cryptography package alone: the
    certificate (context, fleet, device, key, NUL-separated), the advert (protocol, " advert", session as u64,
    device, NUL, c, s) and the survivors (protocol, " survivors", setup digest, u32 count, u32 indices) verify
    in tests/vectors under the vectors' root."""
    import struct
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    vectors = Path(__file__).parent / "vectors"

    def load(name: str) -> dict:
        return json.loads((vectors / f"{name}.expected.json").read_text())

    advert = load("secagg-advertise")
    message, raw = advert["message"], {k: base64.b64decode(v) for k, v in advert["message"].items()
                                       if k in ("c_public", "s_public", "identity", "certificate", "signature")}
    root = Ed25519PublicKey.from_public_bytes(base64.b64decode(advert["root"]))
    root.verify(raw["certificate"], b"fedper-identity/1\0demo\0phone-1\0" + raw["identity"])
    identity = Ed25519PublicKey.from_public_bytes(raw["identity"])
    identity.verify(raw["signature"], b"fedper-secagg/2 advert" + struct.pack(">Q", message["session"])
                    + b"phone-1\0" + raw["c_public"] + raw["s_public"])
    survivors = b"fedper-secagg/2 survivors" + bytes.fromhex(advert["setup_digest"]) + struct.pack(">4I", 3, 0, 1, 2)
    up = load("secagg-consistency-up")
    identity.verify(base64.b64decode(up["message"]["signature"]), survivors)
    for index, text in load("secagg-unmask-down")["message"]["signatures"].items():
        signer = base64.b64decode(text)
        root.verify(signer[32:96], b"\0".join((b"fedper-identity/1", b"demo", ("phone-1", "phone-2")[int(index)]
                                              .encode(), signer[:32])))
        Ed25519PublicKey.from_public_bytes(signer[:32]).verify(signer[96:], survivors)
