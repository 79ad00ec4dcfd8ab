"""SecAgg+ (fedper.secagg): the sum is exact up to the documented quantization, dropouts before and after
masking are recovered, an honest device never reveals both kinds of share of one device, tampered shares
are refused, fewer than t Shamir shares give nothing, and a device's traffic grows with k, not n.

Every message crosses a serialization boundary (the wire's JSON stage messages through SecAggWire,
safetensors for the masked vector), as it would through the coordinator."""

from __future__ import annotations

import base64
import math
import secrets
from dataclasses import replace

import numpy as np
import pytest

from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.secagg import (
    KEY_BYTES,
    NONCE_BYTES,
    SEALED_SHARE_BYTES,
    SHARE_BYTES,
    EncryptedShare,
    EncryptedShares,
    KeyAdvert,
    MaskedInput,
    NeighbourKeys,
    NotEnoughShares,
    SecAggClient,
    SecAggConfig,
    SecAggError,
    SecAggServer,
    SecAggWire,
    ShareDecryptionError,
    UnmaskRefused,
    UnmaskRequest,
    UnmaskResponse,
    VectorSpec,
    degree_for,
    quantization_scale,
    quantize,
    reconstruct,
    shamir_combine,
    shamir_split,
)
from fedper.wire import (
    KEY_B64,
    PAIR_B64,
    SEALED_SHARE_B64,
    SecAggAdvertise,
    SecAggNeighbours,
    SecAggShares,
    SecAggUnmask,
    SecAggUnmaskRequest,
    WireError,
)


def through_wire(message, traffic: dict[int, int], device: int, config: SecAggConfig, *, upward: bool = True):
    """The message as the other side decodes it, through the bytes MQTT would carry (SecAggWire's JSON stage
    messages, or the masked input's safetensors); its bytes counted against `device`. `upward`: a bundle of
    shares sent by `device` (else relayed to it)."""
    wire = SecAggWire(round=1, session=config.round)
    if isinstance(message, MaskedInput):
        payload = message.to_safetensors()
        decoded = MaskedInput.from_safetensors(payload)
    elif isinstance(message, KeyAdvert):
        payload = wire.advertise((message.c_public, message.s_public)).encode()
        decoded = KeyAdvert(config.round, device, *wire.keys(SecAggAdvertise.decode(payload)))
    elif isinstance(message, NeighbourKeys):
        payload = wire.neighbours(config, message, VectorSpec()).encode()
        setup, decoded, _ = wire.setup(SecAggNeighbours.decode(payload))
        assert setup == config
    elif isinstance(message, EncryptedShares):
        payload = wire.shares(message, upward=upward).encode()
        decoded = wire.bundle(SecAggShares.decode(payload), device, upward=upward)
    elif isinstance(message, UnmaskRequest):
        payload = wire.unmask_request(message).encode()
        decoded = wire.request(SecAggUnmaskRequest.decode(payload), device)
    else:
        payload = wire.unmask(message).encode()
        decoded = wire.response(SecAggUnmask.decode(payload), device)
    traffic[device] = traffic.get(device, 0) + len(payload)
    return decoded


def run_round(config: SecAggConfig, vectors: np.ndarray, *, gone_before_keys=(), gone_before_shares=(),
              gone_before_input=(), gone_before_unmask=(), rng=None):
    """One round over all devices; a device in a `gone_before_*` set vanishes before sending that stage's
    message. Returns the server's result and each device's bytes (up and down, the masked vector included)."""
    clients = [SecAggClient(config, u) for u in range(config.devices)]
    server = SecAggServer(config)
    traffic: dict[int, int] = {}
    keys = server.neighbour_keys(through_wire(c.advertise(), traffic, c.device, config) for c in clients
                                 if c.device not in gone_before_keys)
    bundles = [through_wire(clients[u].share_keys(through_wire(m, traffic, u, config)), traffic, u, config)
               for u, m in keys.items() if u not in gone_before_shares]
    inbox = server.relay_shares(bundles)
    masked = [through_wire(clients[u].masked_input(through_wire(m, traffic, u, config, upward=False), vectors[u],
                                                   rng), traffic, u, config)
              for u, m in inbox.items() if u not in gone_before_input]
    requests = server.unmask_requests(masked)
    responses = [through_wire(clients[u].unmask(through_wire(m, traffic, u, config)), traffic, u, config)
                 for u, m in requests.items() if u not in gone_before_unmask]
    return server.aggregate(responses), traffic


def quantization_bound(config: SecAggConfig, count: int, stochastic: bool = False) -> float:
    """The largest error per coordinate of the sum of `count` devices: half a step each (nearest), or a step."""
    step = 1 / quantization_scale(config.clip, config.value_bits)
    return count * step * (1.0 if stochastic else 0.5) + 1e-9


def test_sum_equals_numpy_sum_up_to_quantization() -> None:
    config = SecAggConfig.create(round=3, devices=10, length=500, clip=1.0)
    vectors = np.random.default_rng(0).uniform(-1, 1, (10, 500))
    result, _ = run_round(config, vectors)
    assert result.survivors == tuple(range(10))
    error = np.abs(result.sum - vectors.sum(axis=0)).max()
    assert error <= quantization_bound(config, 10)
    assert error > 0  # quantization is real; the test would notice an exact-float shortcut

    stochastic, _ = run_round(config, vectors, rng=np.random.default_rng(1))
    assert np.abs(stochastic.sum - vectors.sum(axis=0)).max() <= quantization_bound(config, 10, stochastic=True)


def test_values_are_clipped_before_quantization_and_nan_stays_on_the_device() -> None:
    config = SecAggConfig.create(round=1, devices=4, length=3, clip=0.5)
    vectors = np.array([[2.0, -3.0, 0.1]] * 4)
    result, _ = run_round(config, vectors)
    np.testing.assert_allclose(result.sum, [2.0, -2.0, 0.4], atol=quantization_bound(config, 4))
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.array([0.0, np.nan]), 1.0, 20)


def keeps_threshold(config: SecAggConfig, sharers: set[int], answering: set[int]) -> bool:
    """The documented condition for a round to close: every contributor and every device that dropped
    after sharing keeps t neighbours that answer stage 4."""
    return all(len(answering & set(config.neighbours(u))) >= config.threshold for u in sharers)


@pytest.mark.parametrize(("degree", "majority"), [(29, True), (None, False)],
                         ids=["complete-graph-majority-t", "sparse-graph-third-t"])
def test_thirty_percent_vanishing_after_masking_and_some_before_still_give_the_right_sum(degree, majority) -> None:
    """1 device gone before stage 1, 1 before 2, 1 before 3, and 9 (30 %) after sending the masked input.
    With the majority threshold that needs about the complete graph at n = 30; the sparse default graph
    (k = 16) tolerates it with t = k/3 + 1, the semi-honest setting (docs/privacy.md)."""
    probe = SecAggConfig.create(round=7, devices=30, length=64, clip=1.0, degree=degree, graph_seed=11)
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
    error = np.abs(result.sum - vectors[contributed].sum(axis=0)).max()
    assert error <= quantization_bound(config, len(contributed))


def test_degree_for_a_dropout_rate_grows_with_log_n_and_a_round_at_it_closes() -> None:
    assert degree_for(100, 0.3) == 99  # heavy dropout at a small fleet: the complete graph
    heavy = [degree_for(n, 0.3) for n in (1_000, 10_000, 100_000)]
    assert heavy == sorted(heavy) and heavy[-1] < 1.5 * heavy[0]  # a hundred times the devices, +40 % in k
    assert degree_for(50, 0.1) == 20 and degree_for(50, 0.1, failure=0.1) < 20

    config = SecAggConfig.create(round=1, devices=50, length=32, clip=1.0, degree=degree_for(50, 0.1), graph_seed=4)
    vectors = np.random.default_rng(6).uniform(-1, 1, (50, 32))
    rng = np.random.default_rng(7)
    silent = {u for u in range(50) if rng.random() < 0.1}  # each device gone after masking with probability 0.1
    result, _ = run_round(config, vectors, gone_before_unmask=silent)
    assert result.survivors == tuple(range(50)) and silent
    assert np.abs(result.sum - vectors.sum(axis=0)).max() <= quantization_bound(config, 50)


def test_too_many_dropouts_fail_loudly_rather_than_give_a_wrong_sum() -> None:
    config = SecAggConfig.create(round=1, devices=12, length=8, clip=1.0, degree=6)
    vectors = np.zeros((12, 8))
    gone = set(range(1, 12, 2)) | {2}  # 7 of 12 never answer stage 4: some neighbourhood keeps < t = 4
    with pytest.raises(NotEnoughShares):
        run_round(config, vectors, gone_before_unmask=gone)


def started_round(devices: int = 6, dropped_after_shares: int | None = None):
    """Clients and server at stage 4 (complete graph), one device gone before its masked input."""
    config = SecAggConfig.create(round=2, devices=devices, length=4, clip=1.0)
    clients = [SecAggClient(config, u) for u in range(devices)]
    server = SecAggServer(config)
    keys = server.neighbour_keys(c.advertise() for c in clients)
    inbox = server.relay_shares(clients[u].share_keys(m) for u, m in keys.items())
    requests = server.unmask_requests(clients[u].masked_input(m, np.zeros(4)) for u, m in inbox.items()
                                      if u != dropped_after_shares)
    return config, clients, server, requests


def test_an_honest_device_refuses_to_reveal_both_kinds_of_share_of_one_device() -> None:
    config, clients, _, requests = started_round(dropped_after_shares=5)
    assert requests[0].dropped == (5,) and 3 in requests[0].survivors
    greedy = replace(requests[0], dropped=(3, 5))  # 3 survived: its key share would unmask its input
    with pytest.raises(UnmaskRefused):
        clients[0].unmask(greedy)

    # nor across two requests: after giving device 3's self-mask share, its key share is refused
    clients[1].unmask(requests[1])
    with pytest.raises(UnmaskRefused):
        clients[1].unmask(UnmaskRequest(config.round, 1, (), (3,)))
    assert clients[1].unmask(UnmaskRequest(config.round, 1, (3,), ())).seed_shares  # the same kind again is fine


def test_a_tampered_or_misaddressed_share_is_refused() -> None:
    config = SecAggConfig.create(round=4, devices=5, length=4, clip=1.0)
    clients = [SecAggClient(config, u) for u in range(5)]
    server = SecAggServer(config)
    keys = server.neighbour_keys(c.advertise() for c in clients)
    inbox = server.relay_shares(clients[u].share_keys(m) for u, m in keys.items())
    original = inbox[0].shares[0]
    flipped = bytearray(original.ciphertext)
    flipped[20] ^= 0x01
    tampered = EncryptedShares(config.round, 0, (EncryptedShare(original.sender, 0, original.nonce, bytes(flipped)),
                                                 *inbox[0].shares[1:]))
    with pytest.raises(ShareDecryptionError):
        clients[0].masked_input(tampered, np.zeros(4))

    # the server relabels device 2's share as coming from device 3: the associated data no longer matches
    from_two = next(s for s in inbox[1].shares if s.sender == 2)
    relabelled = EncryptedShares(config.round, 1, tuple(replace(s, sender=3, ciphertext=from_two.ciphertext,
                                                                nonce=from_two.nonce) if s.sender == 3 else s
                                                        for s in inbox[1].shares))
    with pytest.raises(ShareDecryptionError):
        clients[1].masked_input(relabelled, np.zeros(4))


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
    config, clients, server, _ = started_round()
    with pytest.raises(SecAggError):  # a second masked input under the same masks would leak a difference
        clients[0].masked_input(EncryptedShares(config.round, 0, ()), np.ones(4))
    with pytest.raises(SecAggError):  # a masked input after the stage closed, or from nobody invited
        server.unmask_requests([])

    config = SecAggConfig.create(round=9, devices=3, length=20_000, clip=1.0)
    clients = [SecAggClient(config, u) for u in range(3)]
    server = SecAggServer(config)
    keys = server.neighbour_keys(c.advertise() for c in clients)
    inbox = server.relay_shares(clients[u].share_keys(m) for u, m in keys.items())
    masked = clients[0].masked_input(inbox[0], np.zeros(20_000)).masked
    zero = quantize(np.zeros(20_000), config.clip, config.value_bits)
    assert (masked != zero).mean() > 0.99
    assert abs(masked.astype(np.float64).mean() / 2**32 - 0.5) < 0.01  # uniform over the whole field


def test_the_server_refuses_inputs_outside_the_protocol() -> None:
    config = SecAggConfig.create(round=2, devices=4, length=4, clip=1.0)
    clients = [SecAggClient(config, u) for u in range(4)]
    server = SecAggServer(config)
    keys = server.neighbour_keys(c.advertise() for c in clients if c.device != 3)
    inbox = server.relay_shares(clients[u].share_keys(m) for u, m in keys.items())
    stranger = MaskedInput(config.round, 3, np.zeros(4, dtype=np.uint32))  # never shared its keys
    with pytest.raises(SecAggError):
        server.unmask_requests([clients[0].masked_input(inbox[0], np.zeros(4)), stranger])
    with pytest.raises(SecAggError):
        SecAggServer(config).neighbour_keys([clients[0].advertise(), replace(clients[1].advertise(), round=1)])


def test_messages_round_trip() -> None:
    """Every kernel message comes back equal through SecAggWire and the wire's JSON, both ways."""
    config = SecAggConfig.create(round=5, devices=50, length=7, clip=0.25, graph_seed=3)
    advert = KeyAdvert(5, 2, b"\x01" * 32, b"\x02" * 32)
    sealed = {"nonce": b"n" * NONCE_BYTES, "ciphertext": b"c" * (SEALED_SHARE_BYTES - NONCE_BYTES)}
    for message, upward in ((advert, True), (NeighbourKeys(5, 0, (advert,)), False),
                            (EncryptedShares(5, 2, (EncryptedShare(2, 0, **sealed),)), True),
                            (EncryptedShares(5, 0, (EncryptedShare(2, 0, **sealed),)), False),
                            (UnmaskRequest(5, 0, (2, 3), (4,)), False),
                            (UnmaskResponse(5, 0, {2: b"s" * SHARE_BYTES}, {4: b"k" * SHARE_BYTES}), True)):
        assert through_wire(message, {}, message.device, config, upward=upward) == message
    masked = MaskedInput(1, 2, np.arange(10, dtype=np.uint32))
    decoded = MaskedInput.from_safetensors(masked.to_safetensors())
    assert (decoded.round, decoded.device) == (1, 2) and np.array_equal(decoded.masked, masked.masked)
    with pytest.raises(SecAggError):
        MaskedInput.from_safetensors(b"\x00" * 16)
    wire = SecAggWire(round=1, session=5)
    spec = VectorSpec(weight_scale=40, clip_norm=0.2, noise_std=0.01, weights="uniform", tensors="trainable")
    setup, _, got = wire.setup(SecAggNeighbours.decode(wire.neighbours(config, NeighbourKeys(5, 0, ()), spec).encode()))
    assert (setup, got) == (config, spec)


def test_the_wire_bounds_are_the_kernel_byte_sizes_and_other_sizes_are_refused() -> None:
    def b64(size: int) -> int:
        return 4 * math.ceil(size / 3)

    assert (b64(KEY_BYTES), b64(2 * KEY_BYTES), b64(SEALED_SHARE_BYTES)) == (KEY_B64, PAIR_B64, SEALED_SHARE_B64)
    assert b64(SHARE_BYTES) == PAIR_B64  # an unmask answer's share fits the same bound
    wire = SecAggWire(round=1, session=1)
    short = base64.b64encode(b"x" * (SEALED_SHARE_BYTES - 1)).decode()
    for refused in (lambda: wire.bundle(SecAggShares(1, 1, {"0": short}), 1, upward=True),
                    lambda: wire.keys(SecAggAdvertise(1, 1, short[:44], short[:44])),
                    lambda: wire.response(SecAggUnmask(1, 1, {"0": "AAAA"}, {}), 1)):
        with pytest.raises(WireError) as e:
            refused()
        assert e.value.code == "bad_message"


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
        config = SecAggConfig.create(round=1, devices=devices, length=1, clip=1.0, graph_seed=devices)
        assert config.degree == min(devices - 1, 2 * math.ceil(1.5 * math.log2(devices)))
        for u in range(devices):
            assert len(config.neighbours(u)) == config.degree and u not in config.neighbours(u)
            assert all(u in config.neighbours(v) for v in config.neighbours(u))


def per_device_bytes(devices: int, degree: int | None) -> tuple[int, float]:
    """The degree and the mean bytes per device (up and down) of a round with a 16-value vector."""
    config = SecAggConfig.create(round=1, devices=devices, length=16, clip=1.0, degree=degree, graph_seed=devices)
    _, traffic = run_round(config, np.zeros((devices, 16)))
    return config.degree, sum(traffic.values()) / devices


def test_per_device_cost_grows_with_k_not_n() -> None:
    fixed = [per_device_bytes(n, degree=8)[1] for n in (10, 50, 100)]
    assert max(fixed) / min(fixed) < 1.05  # same k, ten times the devices: the same traffic per device

    grown = {n: per_device_bytes(n, degree=None) for n in (10, 50, 100)}
    k10, bytes10 = grown[10]
    k100, bytes100 = grown[100]
    assert (k10, grown[50][0], k100) == (9, 18, 20)
    assert bytes100 / bytes10 < 1.3 * k100 / k10 < 100 / 10  # proportional to k, far below n's growth


def test_a_100k_vector_sums_exactly_up_to_quantization() -> None:
    config = SecAggConfig.create(round=1, devices=5, length=100_000, clip=0.1, degree=4)
    vectors = np.random.default_rng(3).normal(0, 0.03, (5, 100_000))
    result, traffic = run_round(config, vectors, gone_before_unmask={4})
    clipped = np.clip(vectors, -0.1, 0.1).sum(axis=0)
    assert np.abs(result.sum - clipped).max() <= quantization_bound(config, 5)
    assert all(4 * 100_000 < b < 4 * 100_000 + 4096 for b in traffic.values())  # fp32-sized plus a few KiB
