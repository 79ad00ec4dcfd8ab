"""The update codecs on arrays: exact fp32, bounded fp16/int8 error, refusal of anything malformed."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedper.compression import CODEC_KEY, CODECS, QUANT_KEY, CodecError, channels, decode, encode

finite32 = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
tensor_dicts = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_.]{0,12}", fullmatch=True),
    arrays(np.float32, st.tuples(st.integers(0, 4), st.integers(1, 5)), elements=finite32),
    min_size=1, max_size=4,
)


@settings(max_examples=40, deadline=None)
@given(tensor_dicts)
def test_fp32_round_trip_is_exact(tensors):
    arrays_, metadata = encode(tensors, "fp32")
    back = decode(arrays_, metadata)
    assert metadata[CODEC_KEY] == "fp32" and back.keys() == tensors.keys()
    for name, x in tensors.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], x)


@settings(max_examples=40, deadline=None)
@given(tensor_dicts)
def test_fp16_error_is_within_half_precision(tensors):
    back = decode(*encode(tensors, "fp16"))
    for name, x in tensors.items():
        assert back[name].dtype == np.float32
        # float16 keeps 11 significant bits; below 2**-14 the absolute step is 2**-24
        np.testing.assert_allclose(back[name], x, rtol=2.0**-11, atol=2.0**-24)


@settings(max_examples=40, deadline=None)
@given(tensor_dicts)
def test_int8_error_is_within_half_a_step(tensors):
    arrays_, metadata = encode(tensors, "int8")
    quant = json.loads(metadata[QUANT_KEY])
    back = decode(arrays_, metadata)
    for name, x in tensors.items():
        assert arrays_[name].dtype == np.uint8 and back[name].dtype == np.float32
        if x.size:
            lo, scale = quant[name]
            assert lo == x.min()
            bound = scale / 2 + 4 * np.spacing(np.float32(np.abs(x).max()))
            assert np.abs(back[name].astype(np.float64) - x).max() <= bound


def test_encoded_sizes_shrink_and_integers_pass_through():
    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((64, 64)).astype(np.float32), "steps": np.arange(3, dtype=np.int64)}
    encoded = {codec: encode(tensors, codec, reference=tensors) for codec in CODECS}
    sizes = {codec: sum(a.nbytes for a in arrays_.values()) for codec, (arrays_, _) in encoded.items()}
    assert sizes["fp16"] < 0.55 * sizes["fp32"] and sizes["int8"] < 0.3 * sizes["fp32"]
    assert sizes["int8-delta"] < 0.3 * sizes["fp32"]
    assert sizes["int8-delta-pc"] == sizes["int8-delta-rot"] == sizes["int8-delta"]
    for arrays_, metadata in encoded.values():
        assert arrays_["steps"] is tensors["steps"]
        np.testing.assert_array_equal(decode(arrays_, metadata, tensors)["steps"], tensors["steps"])


def test_int8_delta_puts_its_grid_on_the_change_not_on_the_weights():
    """A round moves weights by ~1e-3 of their range: int8 of whole weights errs by about that much,
    int8-delta by half a step of the change's own grid, and it needs the same reference to decode."""
    rng = np.random.default_rng(0)
    base = {"w": (0.1 * rng.standard_normal((64, 64))).astype(np.float32)}
    update = {"w": (base["w"] + 1e-4 * rng.standard_normal((64, 64))).astype(np.float32)}
    change = update["w"].astype(np.float64) - base["w"]
    plain = decode(*encode(update, "int8"))["w"]
    arrays_, metadata = encode(update, "int8-delta", reference=base)
    delta = decode(arrays_, metadata, base)["w"]
    assert metadata[CODEC_KEY] == "int8-delta"
    scale = json.loads(metadata[QUANT_KEY])["w"][1]
    assert scale <= (change.max() - change.min()) / 255 * (1 + 1e-6)
    delta_error = np.abs(delta.astype(np.float64) - update["w"]).max()
    assert delta_error <= scale / 2 + 2 * np.spacing(np.float32(np.abs(update["w"]).max()))
    assert delta_error < np.abs(plain.astype(np.float64) - update["w"]).max() / 20
    with pytest.raises(CodecError, match="needs that model"):
        encode(update, "int8-delta")
    with pytest.raises(CodecError, match="needs that model"):
        decode(arrays_, metadata)
    for wrong in ({"v": base["w"]}, {"w": base["w"][:3]}):
        with pytest.raises(CodecError, match="no reference tensor"):
            decode(arrays_, metadata, wrong)


def channel_params(metadata: dict[str, str], name: str) -> np.ndarray:
    """The (lo, scale) float32 pairs of one tensor of an int8-delta-pc blob, read as protocol.md says."""
    raw = base64.b64decode(json.loads(metadata[QUANT_KEY])[name])
    return np.array(struct.unpack(f"<{len(raw) // 4}f", raw), np.float64).reshape(-1, 2)


def channel_round_trips(tensors: dict[str, np.ndarray], seed: int, codec: str) -> Iterator[tuple[np.ndarray, ...]]:
    """Each non-empty tensor of a per-channel delta codec's round trip against a random reference, as
    (x, reference, q, decoded, (lo, scale) pairs, the change as float64 channel rows); the
    stored dtypes and the number of pairs of every tensor checked on the way."""
    rng = np.random.default_rng(seed)
    reference = {n: (x + rng.standard_normal(x.shape)).astype(np.float32) for n, x in tensors.items()}
    arrays_, metadata = encode(tensors, codec, reference=reference)
    back = decode(arrays_, metadata, reference)
    for name, x in tensors.items():
        pairs = channel_params(metadata, name)
        assert arrays_[name].dtype == np.uint8 and back[name].dtype == np.float32 and len(pairs) == channels(x.shape)
        if x.size:
            change = (x - reference[name]).reshape(len(pairs), -1).astype(np.float64)
            yield x, reference[name], arrays_[name], back[name], pairs, change


@settings(max_examples=40, deadline=None)
@given(tensor_dicts, st.integers(0, 2**32 - 1))
def test_int8_delta_pc_errs_by_half_a_step_of_each_channels_own_grid(tensors, seed):
    """Every output channel (axis 0) gets its own grid over its own change: the error of each value
    is within half of its channel's step, and that step is 1/255 of the channel's range."""
    for x, reference, _, decoded, pairs, change in channel_round_trips(tensors, seed, "int8-delta-pc"):
        error = np.abs(decoded.astype(np.float64) - x).reshape(len(pairs), -1)
        slack = 4 * np.spacing(np.float32(max(np.abs(x).max(), np.abs(reference).max())))
        np.testing.assert_array_equal(pairs[:, 0], change.min(1))
        assert (pairs[:, 1] >= (change.max(1) - change.min(1)) / 255).all()
        assert (pairs[:, 1] <= (change.max(1) - change.min(1)) / 255 * (1 + 2**-23)).all()
        assert (error.max(1) <= pairs[:, 1] / 2 + slack).all()


def test_int8_delta_pc_gives_a_channel_that_moved_little_its_own_fine_grid():
    """One channel changes 100x more than the others: per tensor, its range sets everybody's step;
    per channel, the others get a grid ~100x finer, and that channel keeps the one it had."""
    rng = np.random.default_rng(0)
    base = {"conv": (0.1 * rng.standard_normal((16, 8, 3, 3))).astype(np.float32)}
    change = 1e-4 * rng.standard_normal((16, 8, 3, 3))
    change[3] *= 100
    update = {"conv": (base["conv"] + change).astype(np.float32)}
    errors = {}
    for codec in ("int8-delta", "int8-delta-pc"):
        arrays_, metadata = encode(update, codec, reference=base)
        back = decode(arrays_, metadata, base)["conv"]
        errors[codec] = np.sqrt(np.square(back.astype(np.float64) - update["conv"]).reshape(16, -1).sum(1))
    others = np.arange(16) != 3
    assert errors["int8-delta-pc"][others].max() < errors["int8-delta"][others].min() / 30
    assert errors["int8-delta-pc"][3] <= 1.01 * errors["int8-delta"][3]
    assert len(channel_params(metadata, "conv")) == 16
    assert json.loads(encode({"v": np.ones(5, np.float32)}, "int8-delta-pc",
                             reference={"v": np.zeros(5, np.float32)})[1][QUANT_KEY])["v"] == base64.b64encode(
        struct.pack("<ff", 1.0, 0.0)).decode()  # a vector is one channel; a constant one has scale 0, all q = 0


def rotation(n: int) -> np.ndarray:
    """int8-delta-rot's map of a channel of n values as protocol.md defines it, built here from scratch:
    y = H (s * d) / n, H by Sylvester's doubling, s_i = -1 where bit i of SHAKE128(b"fedper
    int8-delta-rot") is set (least significant bit first)."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    stream = hashlib.shake_128(b"fedper int8-delta-rot").digest((n + 7) // 8)
    signs = np.array([-1.0 if stream[i // 8] >> (i % 8) & 1 else 1.0 for i in range(n)])
    return h * signs[None, :] / n  # y = rotation @ d


def protocol_grid(q: np.ndarray) -> np.ndarray:
    t = q.astype(np.float64) - 127.5
    return 127.5 + 0.75 * t + t**3 / 65025


@settings(max_examples=40, deadline=None)
@given(tensor_dicts, st.integers(0, 2**32 - 1))
def test_int8_delta_rot_errs_within_its_grid_on_each_rotated_channel(tensors, seed):
    """Each channel (rotated when its length is a power of two) is covered by its float32 grid
    [lo, lo + 255 scale], scale within float32 rounding of 1/255 of the rotated range, and each
    rotated value errs by at most half the widest step (0.75 scale): in the original values, by
    0.75 scale per value unrotated, 0.75 scale * n in L2 over a rotated channel of n."""
    for x, reference, stored, decoded, pairs, change in channel_round_trips(tensors, seed, "int8-delta-rot"):
        n = change.shape[1]
        rotated = n in (2, 4)  # the powers of two these shapes have
        y = change @ rotation(n).T if rotated else change
        lo, scale = pairs[:, 0], pairs[:, 1]
        assert (lo <= y.min(1)).all() and (lo + 255 * scale >= y.max(1) - 2**-40 * np.abs(y).max(1)).all()
        assert (scale <= (y.max(1) - lo) / 255 * (1 + 2**-22)).all()
        q = stored.reshape(len(pairs), -1).astype(np.int64)
        level = lo[:, None] + scale[:, None] * protocol_grid(q)
        for neighbour in (np.maximum(q - 1, 0), np.minimum(q + 1, 255)):  # q is the nearest level
            other = lo[:, None] + scale[:, None] * protocol_grid(neighbour)
            assert (np.abs(y - level) <= np.abs(y - other) + 2**-40 * np.abs(y).max()).all()
        error = (decoded.astype(np.float64) - x).reshape(len(pairs), -1)
        slack = 8 * n * np.spacing(np.float32(max(np.abs(x).max(), np.abs(reference).max())))
        if rotated:
            assert (np.sqrt(np.square(error).sum(1)) <= 0.75 * scale * n + slack).all()
        else:
            assert (np.abs(error).max(1) <= 0.75 * scale + slack).all()


def test_int8_delta_rot_hand_written_vector():
    """The worked example of protocol.md, both ways. Decoding: q and the (lo, scale) pairs written
    here, the values worked out by hand. Encoding: a change d = s * H e_0 = s (the signs) rotates
    to y = e_0, a grid from 0 to 1 whose ends are levels 0 and 255."""
    signs = np.array([1.0, -1.0, 1.0, 1.0])
    np.testing.assert_array_equal(rotation(4)[0] * 4, signs)  # the first row of H is all ones
    arrays_ = {"w": np.array([[255, 0, 0, 0], [0, 0, 0, 0]], np.uint8), "b": np.array([0, 255, 128], np.uint8)}
    quant = {"w": pairs_b64(-0.5, 2**-8, 0.25, 0.0), "b": pairs_b64(1.0, 0.5)}
    metadata = {CODEC_KEY: "int8-delta-rot", QUANT_KEY: json.dumps(quant)}
    reference = {"w": np.ones((2, 4), np.float32), "b": np.zeros(3, np.float32)}
    back = decode(arrays_, metadata, reference)
    # channel 0: y = (-0.5 + 255/256, -0.5, -0.5, -0.5); H y = (-1.00390625, 0.99609375 x 3); times s, plus 1
    np.testing.assert_array_equal(back["w"], [[-0.00390625, 0.00390625, 1.99609375, 1.99609375], [2, 1, 1, 1]])
    # "b" has 3 values, not rotated: 1 + 0.5 GRID[q], GRID[128] = 127.875 + 1/520200, 64.9375 in float32
    np.testing.assert_array_equal(back["b"], [1.0, 128.5, 64.9375])
    assert protocol_grid(np.array([0, 128, 255])).tolist() == [0.0, 127.875 + 1 / 520200, 255.0]

    update = {"w": np.array([[1, -1, 1, 1]], np.float32) * np.float32(0.5) + np.float32(2.0)}
    arrays_, metadata = encode(update, "int8-delta-rot", reference={"w": np.full((1, 4), 2.0, np.float32)})
    assert arrays_["w"].tolist() == [[255, 0, 0, 0]]
    assert channel_params(metadata, "w").tolist() == [[0.0, 0.0019607844296842813]]  # the float32 just above 1/510


def test_int8_delta_rot_errs_less_than_a_grid_per_channel_on_heavy_tailed_changes():
    """A channel's change is heavy-tailed: a few values set its range. Rotated, it is nearly Gaussian,
    a narrower range for the same spread: less error than int8-delta-pc's for the same bytes."""
    rng = np.random.default_rng(3)
    base = {"w": (0.1 * rng.standard_normal((64, 128))).astype(np.float32)}
    update = {"w": (base["w"] + 1e-3 * rng.laplace(size=(64, 128)) * rng.uniform(0.1, 10, (64, 1))).astype(np.float32)}
    errors, sizes = {}, {}
    for codec in ("int8-delta-pc", "int8-delta-rot"):
        arrays_, metadata = encode(update, codec, reference=base)
        errors[codec] = np.sqrt(np.square(decode(arrays_, metadata, base)["w"].astype(np.float64) - update["w"]).sum())
        sizes[codec] = arrays_["w"].nbytes + len(metadata[QUANT_KEY])
    assert errors["int8-delta-rot"] < 0.8 * errors["int8-delta-pc"]
    assert sizes["int8-delta-rot"] == sizes["int8-delta-pc"]


def pairs_b64(*values: float) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


@pytest.mark.parametrize(("quant", "match"), [
    ({"w": pairs_b64(0, 1)}, "2 \\(lo, scale\\) float32 pairs"),  # one channel for a (2, 3) tensor
    ({"w": pairs_b64(0, 1, 0, 1, 0, 1)}, "2 \\(lo, scale\\) float32 pairs"),
    ({"w": [0, 1]}, "must be base64"),
    ({"w": "!" * 24}, "not valid base64"),
    ({"w": "A" * 10**6}, "must be base64"),  # refused by its length, before anything is decoded
    ({"w": pairs_b64(0, 1, float("nan"), 1)}, "finite"),
    ({"w": pairs_b64(0, 1, 0, float("inf"))}, "finite"),
    ({"w": pairs_b64(0, 1, 0, -1e-3)}, "scale >= 0"),
    ({"w": pairs_b64(0, 1, 3e38, 3e38)}, "NaN or Inf"),
    ({"w": pairs_b64(0, 1, 0, 1), "v": pairs_b64(0, 1)}, "not in the arrays"),
    ({}, "parameters are missing"),
])
def test_int8_delta_pc_refuses_malformed_channel_parameters(quant, match):
    """Parameters written by hand, as an untrusted device could: wrong channel count, not base64,
    non-finite or negative, a string far longer than the tensor needs, a tensor that is not there
    (int8-delta-rot reads the same parameters, and refuses the same)."""
    arrays_ = {"w": np.full((2, 3), 7, np.uint8)}
    for codec in ("int8-delta-pc", "int8-delta-rot"):
        metadata = {CODEC_KEY: codec, QUANT_KEY: json.dumps(quant)}
        with pytest.raises(CodecError, match=match):
            decode(arrays_, metadata, {"w": np.zeros((2, 3), np.float32)})
    good = {CODEC_KEY: "int8-delta-pc", QUANT_KEY: json.dumps({"w": pairs_b64(0, 1, -1, 0.5)})}
    np.testing.assert_array_equal(decode(arrays_, good, {"w": np.ones((2, 3), np.float32)})["w"],
                                  [[8, 8, 8], [3.5, 3.5, 3.5]])


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_exact_tensors_stay_float32(codec):
    """A variance spanning orders of magnitude would lose its small entries to quantization: the
    caller keeps such tensors exact, and they come back bit for bit."""
    tensors = {"running_var": np.array([1e-6, 3e-3, 40.0], np.float32), "w": np.linspace(-1, 1, 9, dtype=np.float32)}
    arrays_, metadata = encode(tensors, codec, exact={"running_var"})
    back = decode(arrays_, metadata)
    assert metadata[CODEC_KEY] == codec and arrays_["w"].dtype != np.float32
    np.testing.assert_array_equal(back["running_var"], tensors["running_var"])


def test_fp16_keeps_a_tensor_beyond_its_range_in_float32():
    """A running_var of 1e5 cannot be float16: that tensor travels as float32, the others as float16."""
    tensors = {"running_var": np.array([1e5, 2.0], np.float32), "w": np.array([0.1, -3.0], np.float32)}
    arrays_, metadata = encode(tensors, "fp16")
    assert arrays_["running_var"].dtype == np.float32 and arrays_["w"].dtype == np.float16
    back = decode(arrays_, metadata)
    np.testing.assert_array_equal(back["running_var"], tensors["running_var"])
    np.testing.assert_allclose(back["w"], tensors["w"], rtol=1e-3)


@pytest.mark.parametrize(("tensors", "codec", "match"), [
    ({"w": np.ones(2, np.float32)}, "bf16", "unknown codec"),
    ({"w": np.array([1.0, np.nan], np.float32)}, "int8", "NaN or Inf"),
    ({"w": np.array([np.inf], np.float32)}, "fp32", "NaN or Inf"),
    ({"w": np.ones(2, np.float64)}, "fp32", "float32 tensors"),
    ({"w": np.ones(2, np.uint8)}, "int8", "float32 tensors"),
])
def test_encode_refuses(tensors, codec, match):
    with pytest.raises(CodecError, match=match):
        encode(tensors, codec)


@pytest.mark.parametrize(("arrays_", "metadata", "match"), [
    ({"w": np.ones(2, np.float32)}, {}, "unknown codec"),
    ({"w": np.ones(2, np.float32)}, {CODEC_KEY: "zip"}, "unknown codec"),
    ({"w": np.ones(2, np.float64)}, {CODEC_KEY: "fp16"}, "not what codec fp16 writes"),
    ({"w": np.ones(2, np.float16)}, {CODEC_KEY: "fp32"}, "not what codec fp32 writes"),
    ({"w": np.array([np.inf], np.float16)}, {CODEC_KEY: "fp16"}, "NaN or Inf"),
    ({"w": np.ones(2, np.uint8)}, {CODEC_KEY: "int8"}, "without valid"),
    ({"w": np.ones(2, np.uint8)}, {CODEC_KEY: "int8", QUANT_KEY: "{}"}, "parameters are missing"),
    ({"w": np.ones(2, np.uint8)}, {CODEC_KEY: "int8", QUANT_KEY: '{"w":[0,-1]}'}, "scale >= 0"),
    ({"w": np.ones(2, np.uint8)}, {CODEC_KEY: "int8", QUANT_KEY: '{"w":[0]}'}, "lo, scale"),
    ({"w": np.ones(2, np.uint8)}, {CODEC_KEY: "int8", QUANT_KEY: '{"w":[0,1],"v":[0,1]}'}, "not in the arrays"),
    ({"w": np.ones(2, np.uint8)}, {CODEC_KEY: "int8", QUANT_KEY: '{"w":[3e38,1e38]}'}, "NaN or Inf"),
    ({"w": np.ones(2, np.float32)}, {CODEC_KEY: "int8", QUANT_KEY: '{"w":[0,1]}'}, "not what codec"),
])
def test_decode_refuses_malformed_arrays(arrays_, metadata, match):
    with pytest.raises(CodecError, match=match):
        decode(arrays_, metadata)
