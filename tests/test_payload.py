"""A blob of shared tensors (fedper.payload): only the manifest's shared tensors go in, under any codec;
decoding undoes the codec the sender announced and refuses anything that is not the shared layout."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.aggregation import PackedTensors, WeightedMean
from fedper.compression import CODECS, channels
from fedper.models import build_model, describe, exported_state
from fedper.payload import PayloadError, decode_shared, encode_shared
from fedper.wire import Reassembler, UpdateMeta, WireError, chunk, decode_chunk


def test_decoded_tensors_are_validated() -> None:
    manifest = tiny_manifest()
    assert set(decode_shared(manifest, encode_shared(manifest, tiny_tensors()))) == {"stem.weight", "stem.bias"}
    for bad in ({**tiny_tensors(), "stem.bias": np.array([np.nan, 0], np.float32)},
                {**tiny_tensors(), "stem.bias": np.zeros(3, np.float32)},
                {**tiny_tensors(), "stem.bias": np.zeros(2, np.float64)}, {"stem.bias": np.zeros(2, np.float32)}):
        with pytest.raises(WireError) as e:
            decode_shared(manifest, save(bad))
        assert e.value.code == "bad_tensors"
    with pytest.raises(PayloadError, match="not a valid safetensors"):
        decode_shared(manifest, b"\x00" * 40)


@pytest.fixture(scope="module")
def fleet():
    model = build_model("mobilenet_v1", 4, width=0.25)
    manifest = describe(model, architecture="mobilenet_v1", kp=2, algorithm="fedper", input_size=32)
    state = {k: v.numpy() for k, v in exported_state(model).items()}
    shared = {n: state[n] for n in manifest.names(shared=True)}
    return manifest, state, shared


def send(manifest, tensors, codec: str) -> tuple[bytes, str]:
    """What the coordinator reassembles from a device's update frames, and the codec the chunks announce."""
    meta = UpdateMeta(round=1, n_samples=10, base_digest=manifest.base_digest, codec=codec)
    r = Reassembler(1 << 24)
    for frame in chunk(encode_shared(manifest, tensors, codec), 32 * 1024, "r1-test", meta.to_dict()):
        blob = r.add("dev", frame)
    return blob.data, decode_chunk(frame).meta["codec"]


@pytest.mark.parametrize(
    ("codec", "ratio", "tolerance"), [("fp32", 1.0, 0.0), ("fp16", 0.5, 1e-3), ("int8", 0.25, 0.01)]
)
def test_codecs_shrink_the_update_and_decode_within_their_precision(fleet, codec, ratio, tolerance) -> None:
    """The trainable tensors shrink to `ratio` of their bytes; BatchNorm running statistics travel exact."""
    manifest, _, shared = fleet
    blob, announced = send(manifest, shared, codec)
    plain, _ = send(manifest, shared, "fp32")
    assert announced == codec
    statistics = {t.name for t in manifest.shared_tensors if not t.trainable}
    assert statistics and len(statistics) < len(shared)
    exact_bytes = sum(shared[n].nbytes for n in statistics)
    expected = ratio * (len(plain) - exact_bytes) + exact_bytes
    assert expected <= len(blob) <= 1.1 * expected  # int8 adds its parameters as metadata
    decoded = decode_shared(manifest, blob, codec)
    for name, value in shared.items():
        assert decoded[name].dtype == value.dtype and decoded[name].shape == value.shape
        if name in statistics:
            np.testing.assert_array_equal(decoded[name], value)
        else:
            scale = float(np.abs(value).max()) or 1.0
            assert np.abs(decoded[name] - value).max() <= tolerance * scale, name


def test_encode_refuses_head_tensors_under_every_codec_and_decode_validates(fleet) -> None:
    manifest, state, _ = fleet
    for codec in CODECS:
        with pytest.raises(PayloadError, match="never leave a device"):
            encode_shared(manifest, state, codec, base=state)
    shared = {n: state[n] for n in manifest.names(shared=True)}
    blob = encode_shared(manifest, shared)
    decoded = decode_shared(manifest, blob)
    assert all(np.array_equal(decoded[n], shared[n]) for n in shared)
    assert not any(n.encode() in blob for n in manifest.names(shared=False))

    with pytest.raises(PayloadError, match="not a valid safetensors"):
        decode_shared(manifest, blob[:-5])
    bad = dict(shared, **{"blocks.0.0.weight": np.full_like(shared["blocks.0.0.weight"], np.nan)})
    with pytest.raises(PayloadError, match="NaN or Inf"):
        encode_shared(manifest, bad)
    wrong = dict(shared, **{"blocks.0.0.weight": shared["blocks.0.0.weight"].astype(np.float64)})
    with pytest.raises(PayloadError, match="float64"):
        encode_shared(manifest, wrong)


def test_int8_delta_updates_decode_against_the_rounds_model(fleet) -> None:
    """A device encodes its change from the round's model; the coordinator, holding that model,
    gets the update back within half a step of the change's grid. Without it: bad_tensors."""
    manifest, _, shared = fleet
    rng = np.random.default_rng(1)
    trained = {n: (v + 1e-3 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype == np.float32 else v
               for n, v in shared.items()}
    blob = encode_shared(manifest, trained, "int8-delta", base=shared)
    decoded = decode_shared(manifest, blob, "int8-delta", base=shared)
    for name, value in trained.items():
        change = np.abs(value.astype(np.float64) - shared[name]).max()
        assert np.abs(decoded[name].astype(np.float64) - value).max() <= change / 255 + 1e-6, name
    with pytest.raises(WireError) as refused:
        decode_shared(manifest, blob, "int8-delta")
    assert refused.value.code == "bad_tensors"


def test_int8_delta_pc_round_trips_through_a_blob_within_each_channels_grid(fleet) -> None:
    """Per output channel: each value comes back within half a step of its channel's own change
    grid, BatchNorm statistics exact, and the blob is int8-delta's plus 8 bytes a channel (base64)."""
    manifest, _, shared = fleet
    rng = np.random.default_rng(2)
    rates = {n: 10.0 ** rng.uniform(-5, -2, channels(v.shape)) for n, v in shared.items()}
    trained = {n: (v + rates[n].reshape(-1, *[1] * (v.ndim - 1)) * rng.standard_normal(v.shape)).astype(v.dtype)
               for n, v in shared.items()}
    blob = encode_shared(manifest, trained, "int8-delta-pc", base=shared)
    decoded = decode_shared(manifest, blob, "int8-delta-pc", base=shared)
    statistics = {t.name for t in manifest.shared_tensors if not t.trainable}
    for name, value in trained.items():
        if name in statistics:
            np.testing.assert_array_equal(decoded[name], value)
            continue
        rows = channels(value.shape)
        change = (value - shared[name]).reshape(rows, -1).astype(np.float64)
        error = np.abs(decoded[name].astype(np.float64) - value).reshape(rows, -1).max(1)
        assert (error <= (change.max(1) - change.min(1)) / 510 + 1e-6).all(), name
    params = sum(channels(shared[n].shape) for n in shared if n not in statistics)
    per_tensor = encode_shared(manifest, trained, "int8-delta", base=shared)
    assert 8 * params <= len(blob) - len(per_tensor) <= 8 * params * 4 / 3 + 64
    with pytest.raises(PayloadError, match="needs that model"):
        decode_shared(manifest, blob, "int8-delta-pc")


def test_a_codec_that_does_not_match_the_blob_is_refused(fleet) -> None:
    manifest, _, shared = fleet
    blob, _ = send(manifest, shared, "int8")
    with pytest.raises(WireError) as refused:
        decode_shared(manifest, blob, "fp16")
    assert refused.value.code == "bad_tensors"
    with pytest.raises(WireError, match="codec"):
        decode_shared(manifest, blob, "zip")


def test_blobs_written_by_hand_that_break_the_layout_are_refused(fleet) -> None:
    """safetensors blobs not made by our encoder: a head tensor or a retyped one is bad_tensors under
    any codec the blob names, and so is a codec nobody knows."""
    manifest, state, shared = fleet
    head = manifest.names(shared=False)[0]
    weight = next(t.name for t in manifest.shared_tensors if t.trainable)
    half = {**shared, weight: shared[weight].astype(np.float16)}
    for blob, match in [
        (save({**shared, head: state[head]}, metadata={"fedper.codec": "fp16"}), "never leave a device"),
        (save(half, metadata={"fedper.codec": "fp32"}), "float16"),
        (save(half), "float16"),
        (save(shared, metadata={"fedper.codec": "zip"}), "unknown codec"),
    ]:
        with pytest.raises(PayloadError, match=match) as refused:
            decode_shared(manifest, blob)
        assert refused.value.code == "bad_tensors"


def test_hand_built_per_channel_parameters_that_do_not_fit_are_bad_tensors(fleet) -> None:
    """An int8-delta-pc blob written by hand (safetensors + json + struct + base64): parameters for
    too few channels, a negative scale or a NaN are bad_tensors; the right ones decode."""
    manifest, _, shared = fleet
    weight = next(t.name for t in manifest.shared_tensors if t.trainable and len(t.shape) >= 2)
    rows = manifest.spec(weight).shape[0]
    q = np.full(manifest.spec(weight).shape, 2, np.uint8)

    def blob(*pairs: float) -> bytes:
        quant = json.dumps({weight: base64.b64encode(struct.pack(f"<{len(pairs)}f", *pairs)).decode()})
        return save({**shared, weight: q}, metadata={"fedper.codec": "int8-delta-pc", "fedper.quant": quant})

    for bad, match in [(blob(0.0, 1.0), f"{rows} \\(lo, scale\\) float32 pairs"),
                       (blob(*[0.0, -1.0] * rows), "scale >= 0"), (blob(*[float("nan"), 1.0] * rows), "finite")]:
        with pytest.raises(PayloadError, match=match) as refused:
            decode_shared(manifest, bad, "int8-delta-pc", base=shared)
        assert refused.value.code == "bad_tensors"
    decoded = decode_shared(manifest, blob(*[0.5, 0.25] * rows), "int8-delta-pc", base=shared)
    np.testing.assert_allclose(decoded[weight], shared[weight] + np.float32(1.0), rtol=1e-6)


def hand_blob(entries: list[tuple[str, list[int], tuple[int, int]]], data: bytes, pad: int = 0) -> bytes:
    """A safetensors blob written by hand: (name, shape, data offsets) in header order, float32, and
    `pad` spaces after the header (the format allows any; an odd pad leaves the data unaligned)."""
    header = json.dumps({n: {"dtype": "F32", "shape": s, "data_offsets": list(o)} for n, s, o in entries})
    text = header.encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


def test_an_fp32_blob_decodes_into_read_only_views_that_the_fold_streams_as_one_array(fleet) -> None:
    """decode_shared hands over views into the blob, in manifest order, as one flat float32 run in
    sorted-name order; they cannot be written, and WeightedMean folds them to the bits it folds copies to."""
    manifest, _, shared = fleet
    blob = encode_shared(manifest, shared)
    packed = decode_shared(manifest, blob)
    assert isinstance(packed, PackedTensors)
    assert list(packed) == manifest.names(shared=True)
    assert np.shares_memory(packed.flat, np.frombuffer(blob, np.uint8))
    assert np.array_equal(packed.flat, np.concatenate([shared[n].ravel() for n in sorted(shared)]))
    name = manifest.names(shared=True)[0]
    with pytest.raises(ValueError, match="read-only"):
        packed[name][...] = 0
    other = {n: v * np.float32(0.5) - np.float32(0.25) for n, v in shared.items()}
    for first, second in [(packed, other), (other, packed)]:  # a packed update first or second in a round
        mean, reference = WeightedMean(), WeightedMean()
        mean.add(first, 3)
        mean.add(second, 7)
        reference.add({n: first[n].copy() for n in first}, 3)
        reference.add({n: second[n].copy() for n in second}, 7)
        result, expected = mean.result(), reference.result()
        assert list(result) == list(expected) == list(first)
        assert all(np.array_equal(result[n], expected[n]) for n in expected)
        assert not np.array_equal(result[name], shared[name])  # the two updates really were different


def test_hand_built_fp32_blobs_decode_to_their_values_whatever_their_layout() -> None:
    """Blobs our encoder does not write: data in another order than the names' (valid safetensors: decoded
    by copy, each name its own bytes), an unaligned data section (views still right), and a NaN in
    either (refused: the check runs on what is handed over). A duplicate name is refused."""
    manifest = tiny_manifest()
    weight, bias = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([0.5, -1.25], np.float32)
    in_order = [("stem.bias", [2], (0, 8)), ("stem.weight", [2, 3], (8, 32))]
    reversed_data = [("stem.bias", [2], (24, 32)), ("stem.weight", [2, 3], (0, 24))]
    cases = [(hand_blob(in_order, bias.tobytes() + weight.tobytes()), True),
             (hand_blob(in_order, bias.tobytes() + weight.tobytes(), pad=3), True),
             (hand_blob(reversed_data, weight.tobytes() + bias.tobytes()), False)]
    for blob, packed in cases:
        decoded = decode_shared(manifest, blob)
        assert isinstance(decoded, PackedTensors) is packed
        assert np.array_equal(decoded["stem.weight"], weight) and np.array_equal(decoded["stem.bias"], bias)
        nan = blob[:-4] + struct.pack("<f", float("nan"))  # the last 4 bytes: a value of either tensor
        with pytest.raises(PayloadError, match="NaN"):
            decode_shared(manifest, nan)
    duplicate = (b'{"stem.bias":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                 b'"stem.bias":{"dtype":"F32","shape":[2],"data_offsets":[24,32]},'
                 b'"stem.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]}}')
    with pytest.raises(PayloadError):
        decode_shared(manifest, struct.pack("<Q", len(duplicate)) + duplicate + bytes(32))


def test_packed_tensors_must_tile_their_flat_array_in_name_order() -> None:
    flat = np.arange(8, dtype=np.float32)
    assert list(PackedTensors({"b": flat[2:].reshape(2, 3), "a": flat[:2]}, flat)) == ["b", "a"]
    for arrays in ({"a": flat[2:], "b": flat[:2]},  # sorted names out of the data's order
                   {"a": flat[:2], "b": flat[3:]},  # a gap
                   {"a": flat[:2], "b": flat[2:7]},  # not covering the end
                   {"a": flat[:2], "b": flat[2:].astype(np.float64)}):  # another dtype (a copy)
        with pytest.raises(ValueError):
            PackedTensors(arrays, flat)
    with pytest.raises(ValueError):  # a strided flat spans more memory than its values: not the tensors'
        PackedTensors({"a": flat[:2], "b": flat[2:4]}, flat[::2])
