"""Protocol v1 codec: chunking round trips and every way a chunk stream can be wrong."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import tracemalloc
import zlib
from dataclasses import dataclass
from typing import Annotated, Optional

import pytest
from helpers.frames import frame
from hypothesis import given, settings
from hypothesis import strategies as st
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.payload import encode_shared
from fedper.wire import (
    DEFAULT_CHUNK_SIZE,
    ErrorMessage,
    Int,
    Message,
    Reassembler,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    WireError,
    chunk,
    decode_chunk,
    decode_frame,
)

blobs = st.binary(min_size=0, max_size=3000)
chunk_sizes = st.integers(min_value=1, max_value=700)


def assemble(frames: list[bytes], limit: int = 1 << 20) -> bytes:
    r = Reassembler(limit)
    done = [b for b in (r.add("dev", f) for f in frames) if b is not None]
    assert len(done) == 1 and len(r) == 0
    return done[0].data


@settings(max_examples=150, deadline=None)
@given(blob=blobs, size=chunk_sizes, seed=st.integers(0, 2**32 - 1))
def test_any_blob_any_chunk_size_any_order_round_trips(blob: bytes, size: int, seed: int) -> None:
    frames = chunk(blob, size, "b", {"round": 3})
    assert len(frames) == max(1, -(-len(blob) // size))
    random.Random(seed).shuffle(frames)
    assert assemble(frames) == blob


@settings(max_examples=60, deadline=None)
@given(blob=st.binary(min_size=2, max_size=2000), size=chunk_sizes, data=st.data())
def test_truncated_chunk_is_refused(blob: bytes, size: int, data: st.DataObject) -> None:
    frames = chunk(blob, size, "b")
    i = data.draw(st.integers(0, len(frames) - 1))
    cut = data.draw(st.integers(1, len(frames[i]) - 1))
    with pytest.raises(WireError) as e:
        Reassembler(1 << 20).add("dev", frames[i][:-cut])
    assert e.value.code == "bad_chunk"


@settings(max_examples=60, deadline=None)
@given(blob=st.binary(min_size=1, max_size=2000), size=chunk_sizes, data=st.data())
def test_corrupt_byte_anywhere_is_refused(blob: bytes, size: int, data: st.DataObject) -> None:
    """A flipped bit anywhere fails the frame's crc32 (or, in the prefix, its length checks)."""
    frames = chunk(blob, size, "b")
    i = data.draw(st.integers(0, len(frames) - 1))
    pos = data.draw(st.integers(0, len(frames[i]) - 1))
    bad = bytearray(frames[i])
    bad[pos] ^= 1 << data.draw(st.integers(0, 7))
    frames[i] = bytes(bad)
    r = Reassembler(1 << 20)
    with pytest.raises(WireError):
        for f in frames:
            assert r.add("dev", f) is None or f is not frames[-1]
        raise AssertionError("unreachable")  # a corrupt stream must never complete


@settings(max_examples=40, deadline=None)
@given(blob=st.binary(min_size=10, max_size=2000), size=st.integers(1, 5))
def test_duplicates_same_content_are_harmless_different_content_refused(blob: bytes, size: int) -> None:
    frames = chunk(blob, size, "b")
    assert assemble([*frames[:-1], frames[0], frames[-1]]) == blob  # a QoS 1 redelivery before completion
    other = chunk(bytes(x ^ 0xFF for x in blob), size, "b")  # same blob_id, other content
    r = Reassembler(1 << 20)
    r.add("dev", frames[0])
    with pytest.raises(WireError, match=r"differs|different"):
        r.add("dev", other[0])
        r.add("dev", other[0])


def test_oversized_declared_blob_is_refused_before_any_allocation() -> None:
    frames = chunk(b"x" * 1000, 100, "big")
    with pytest.raises(WireError, match="oversized"):
        Reassembler(max_blob_size=999).add("dev", frames[0])
    header, data = decode_frame(frames[0])
    lying = frame({**header, "size": 10**12, "count": 10**10}, data)  # claims a terabyte (framed by hand)
    r = Reassembler(max_blob_size=10**6)
    with pytest.raises(WireError, match="oversized"):
        r.add("dev", lying)
    assert len(r) == 0


def test_partial_blobs_hold_what_arrived_not_what_they_declare() -> None:
    """Many devices each opening a blob at the size limit with one small chunk must cost their chunks,
    not max_open_blobs x the limit (a cheap way to exhaust the coordinator's memory otherwise)."""
    limit = 16 << 20
    first = chunk(bytes(limit), 1024, "big")[0]  # chunk 0 of a 16 MiB blob: 1 KiB of data
    r = Reassembler(max_blob_size=limit, max_open_blobs=8)
    tracemalloc.start()
    try:
        for device in range(8):
            r.add(f"dev{device}", first)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(r) == 8 and peak < 1 << 20, peak


def test_inconsistent_chunk_headers_are_refused() -> None:
    frames = chunk(b"abcdefghij" * 10, 10, "b", {"round": 1})
    header, data = decode_frame(frames[1])
    r = Reassembler(1 << 20)
    r.add("dev", frames[0])
    with pytest.raises(WireError, match="inconsistent"):
        r.add("dev", frame({**header, "meta": {"round": 2}}, data))
    bad_fields = ({"index": 10}, {"count": 3}, {"chunk_size": 0}, {"index": -1}, {"index": "1"}, {"sha256": "zz"},
                  {"meta": []})
    for bad in bad_fields:
        with pytest.raises(WireError):
            decode_chunk(frame({**header, **bad}, data))


def raw_chunk(blob: bytes, blob_id: str, index: int, chunk_size: int) -> bytes:
    """Chunk `index` of `blob` framed by hand (struct + json + zlib), as a third-party client would."""
    count = max(1, -(-len(blob) // chunk_size))
    header = json.dumps({"v": 1, "blob_id": blob_id, "index": index, "count": count, "size": len(blob),
                         "chunk_size": chunk_size, "sha256": hashlib.sha256(blob).hexdigest(), "meta": {}}).encode()
    body = blob[index * chunk_size : (index + 1) * chunk_size]
    return struct.pack(">II", len(header), zlib.crc32(header + body)) + header + body


def test_reassembler_refuses_newcomers_when_full_and_evicts_nobody() -> None:
    r = Reassembler(1 << 20, max_open_blobs=4)
    for i in range(100):
        if i < 4:
            assert r.add(f"dev{i}", raw_chunk(b"x" * 20, f"b{i}", 0, 10)) is None
        else:
            with pytest.raises(WireError) as refused:
                r.add(f"dev{i}", raw_chunk(b"x" * 20, f"b{i}", 0, 10))
            assert refused.value.code == "over_quota"
    assert len(r) == 4 and r.evicted == 0
    for i in range(4):  # the first four, already in flight, all complete
        assert r.add(f"dev{i}", raw_chunk(b"x" * 20, f"b{i}", 1, 10)).data == b"x" * 20
    assert len(r) == 0 and r.bytes == 0


def test_reassembler_flood_of_one_byte_chunks_displaces_only_the_flooders_own_blobs() -> None:
    """One source opens 20,000 blobs of one-byte chunks and never finishes any, between the chunks
    of three honest sources' half-sent blobs: the honest blobs all complete, the flooder keeps at
    most its own quota of partial blobs, and the memory held stays within the flooder's byte quota."""
    honest = {f"dev{i}": bytes(range(i, i + 200)) for i in range(3)}
    r = Reassembler(4096, max_open_blobs=8, max_blobs_per_source=2, max_bytes_per_source=16384)
    for device, blob in honest.items():
        for index in range(10):
            assert r.add(device, raw_chunk(blob, "update", index, 10)) is None
    held_by_honest = r.bytes
    for n in range(20_000):
        r.add("flooder", raw_chunk(bytes(4096), f"f{n}", n % 4096, 1))
        assert r.bytes <= held_by_honest + 16384
    assert len(r) == 3 + 2 and r.evicted == 20_000 - 2
    for device, blob in honest.items():
        done = [r.add(device, raw_chunk(blob, "update", index, 10)) for index in range(10, 20)]
        assert done[-1].data == blob
    r.discard("flooder")
    assert len(r) == 0 and r.bytes == 0


def test_reassembler_byte_quota_per_source() -> None:
    """A source past its byte quota loses its own older partial blob first; a blob that alone
    costs more than the quota (tiny chunks charge their holding cost) is refused."""
    r = Reassembler(10_000, max_bytes_per_source=12_000)
    big = bytes(6000)
    for index in range(5):
        r.add("a", raw_chunk(big, "old", index, 1000))
    r.add("b", raw_chunk(big, "other", 0, 1000))
    for index in range(5):
        r.add("a", raw_chunk(big, "new", index, 1000))
    assert r.evicted == 1 and len(r) == 2  # "old" made room for "new"; "b" untouched
    assert r.add("a", raw_chunk(big, "new", 5, 1000)).data == big
    with pytest.raises(WireError) as refused:
        for index in range(1000):
            r.add("a", raw_chunk(bytes(1000), "tiny", index, 1))
    assert refused.value.code == "over_quota" and len(r) == 1
    assert r.add("b", raw_chunk(big, "other", 1, 1000)) is None


def test_reassembler_global_byte_cap_refuses_the_newcomer() -> None:
    r = Reassembler(10_000, max_bytes_per_source=16_000, max_bytes=30_000)
    for index in range(8):
        r.add("a", raw_chunk(bytes(10_000), "a", index, 1000))
    for index in range(8):
        r.add("b", raw_chunk(bytes(10_000), "b", index, 1000))
    with pytest.raises(WireError) as refused:
        for index in range(2):
            r.add("c", raw_chunk(bytes(10_000), "c", index, 1000))
    assert refused.value.code == "over_quota" and r.evicted == 0 and len(r) == 2
    for index in range(8, 10):
        r.add("a", raw_chunk(bytes(10_000), "a", index, 1000))
    assert len(r) == 1  # "a" completed and freed its bytes: "c" fits now
    assert r.add("c", raw_chunk(bytes(10), "c2", 0, 10)).data == bytes(10)


def test_sources_do_not_mix() -> None:
    frames = chunk(b"0123456789" * 3, 10, "same-id")
    r = Reassembler(1 << 20)
    assert r.add("a", frames[0]) is None and r.add("b", frames[1]) is None
    assert r.add("a", frames[1]) is None
    assert r.add("a", frames[2]).data == b"0123456789" * 3


def test_default_chunk_fits_aws_iot_core() -> None:
    meta = UpdateMeta(1, 5, "d", {"accuracy": 0.5}).to_dict()
    frames = chunk(encode_shared(tiny_manifest(), tiny_tensors()), blob_id="x", meta=meta)
    assert len(frames[0]) < DEFAULT_CHUNK_SIZE + 1024 < 128 * 1000


def test_messages_round_trip_and_ignore_unknown_fields() -> None:
    for msg in (Register(5, "sha256:ab", "agent/1"), ErrorMessage("late_update", "old", 3), ErrorMessage("x", "y"),
                RoundInfo(2, 5, "open", 1.5, "r2", 10, "0" * 64, 1, "sha256:ab"), UpdateMeta(1, 2, "d", {"acc": 1.0})):
        body = json.loads(msg.encode())
        assert type(msg).decode(json.dumps({**body, "future_field": [1]}).encode()) == msg


@pytest.mark.parametrize("payload", [
    b"", b"\xff\xfe", b"[]", b'{"v":1}', b'{"v":2,"n_samples":1,"base_digest":"a","software":"s"}',
    b'{"v":1,"n_samples":"7","base_digest":"a","software":"s"}',
    b'{"v":1,"n_samples":true,"base_digest":"a","software":"s"}',
    b'{"v":1,"n_samples":NaN,"base_digest":"a","software":"s"}', b'{"v":1e999}', b"[" * 100_000,
])
def test_bad_json_messages_are_refused(payload: bytes) -> None:
    with pytest.raises(WireError) as e:
        Register.decode(payload)
    assert e.value.code == "bad_message"


def test_topics_and_names() -> None:
    t = Topics("lab")
    assert t.update("pixel-7") == "fedper/v1/lab/update/pixel-7"
    assert t.parse("fedper/v1/lab/register/pixel-7") == ("register", "pixel-7")
    for bad in ("fedper/v1/other/update/x", "fedper/v1/lab/round", "fedper/v1/lab/update/a/b", "fedper/v1/lab/error/x"):
        with pytest.raises(WireError):
            t.parse(bad)
    for bad_name in ("", "a/b", "+", "#", "x" * 65):
        with pytest.raises(WireError):
            t.update(bad_name)


@dataclass(frozen=True)
class Hinted(Message):
    """A message written with typing's own spellings: Optional[...] and a bound inside Annotated."""

    count: Optional[int]  # noqa: UP045 (the spelling under test)
    size: Annotated[int, Int(1, 10)] | None = None
    weight: Optional[float] = None  # noqa: UP045


@dataclass(frozen=True)
class Unwired(Message):
    shape: tuple[int, ...]


def test_optional_fields_are_checked_as_their_type_or_null() -> None:
    assert Hinted.from_dict({"count": None}) == Hinted(None)
    assert Hinted.decode(Hinted(3, 10, 0.5).encode()) == Hinted(3, 10, 0.5)
    assert RoundInfo.from_dict({**RoundInfo(1, 2, "open", 1.5, "r1", 10, "a" * 64, 1, "d").to_dict(),
                                "secagg_session": None}).secagg_session is None
    for body in ({}, {"count": -1}, {"count": 1.0}, {"count": None, "size": 0}, {"count": None, "size": 11},
                 {"count": None, "weight": "x"}, {"count": None, "weight": True}):
        with pytest.raises(WireError) as refused:
            Hinted.from_dict(body)
        assert refused.value.code == "bad_message", body
    round_info = RoundInfo(1, 2, "open", 1.5, "r1", 10, "a" * 64, 1, "d", secagg_session=4).to_dict()
    with pytest.raises(WireError, match=r"secagg_session must be an integer in 1\.\."):
        RoundInfo.from_dict({**round_info, "secagg_session": 0})
    with pytest.raises(TypeError, match="no wire type"):  # a message defined wrongly fails loudly, never unchecked
        Unwired.from_dict({"shape": [1]})
