"""Wire protocol v1 codec (docs/protocol.md): topics, JSON messages, chunk frames, reassembly.

Everything here is pure (bytes in, bytes out) so the coordinator, the agent and the fuzz tests
share one implementation. Parameters reach the wire only through `fedper.tensors.pack_shared`,
which refuses device-local tensors: the head cannot be encoded, so it cannot be sent.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from fedper import compression
from fedper.manifest import Manifest
from fedper.tensors import TensorError, check_shared, pack_shared, unpack_shared

VERSION = 1
PREFIX = f"fedper/v{VERSION}"
# AWS IoT Core caps a message at 128 KB: 63 KiB of data + a <1 KiB header keeps a chunk under 64 KiB.
DEFAULT_CHUNK_SIZE = 63 * 1024
MAX_HEADER_SIZE = 16 * 1024
MAX_CHUNK_SIZE = 1 << 20  # a peer may choose its chunk size, up to this
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # fleet, device and blob ids: safe in a topic level

# Error codes sent on .../error/<device> and counted by the coordinator (docs/protocol.md, "Errors").
ERROR_CODES = (
    "bad_message",  # not decodable: bad framing, JSON, missing or mistyped fields, unsupported version
    "bad_chunk",  # corrupt (checksum), truncated, oversized or inconsistent chunk
    "digest_mismatch",  # the device's manifest base_digest is not the coordinator's
    "unknown_device",  # an update from a device that has not registered
    "late_update",  # an update for a round that is not the open one
    "duplicate_update",  # a second update for a round already accepted from this device
    "bad_tensors",  # wrong names, shapes or dtypes, NaN or Inf
    "rejected",  # a valid update the aggregation rule refused (e.g. non-positive n_samples)
)


class WireError(ValueError):
    """A message that does not follow protocol v1; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise WireError("bad_message", f"{what} {name!r} must match {NAME_RE.pattern}")
    return name


# ---------------------------------------------------------------- topics


@dataclass(frozen=True)
class Topics:
    """Topic names of one fleet: fedper/v1/<fleet>/..."""

    fleet: str

    def __post_init__(self) -> None:
        check_name(self.fleet, "fleet")

    @property
    def base(self) -> str:
        return f"{PREFIX}/{self.fleet}"

    def register(self, device: str) -> str:
        return f"{self.base}/register/{check_name(device, 'device')}"

    def presence(self, device: str) -> str:
        return f"{self.base}/presence/{check_name(device, 'device')}"

    def update(self, device: str) -> str:
        return f"{self.base}/update/{check_name(device, 'device')}"

    def error(self, device: str) -> str:
        return f"{self.base}/error/{check_name(device, 'device')}"

    def model(self, blob_id: str, index: int) -> str:
        return f"{self.base}/model/{check_name(blob_id, 'blob_id')}/{index}"

    @property
    def round(self) -> str:
        return f"{self.base}/round"

    @property
    def state(self) -> str:
        return f"{self.base}/state"

    def parse(self, topic: str) -> tuple[str, str]:
        """(kind, device) for device -> coordinator topics; WireError for anything else."""
        parts = topic.split("/")
        if len(parts) != 5 or "/".join(parts[:3]) != self.base or parts[3] not in ("register", "presence", "update"):
            raise WireError("bad_message", f"not a device topic of fleet {self.fleet}: {topic}")
        return parts[3], check_name(parts[4], "device")


# ---------------------------------------------------------------- JSON messages

M = TypeVar("M", bound="Message")


@dataclass(frozen=True)
class Message:
    """A JSON object message. Unknown fields are ignored; a missing or mistyped field is an error."""

    _optional: ClassVar[frozenset[str]] = frozenset()

    def encode(self) -> bytes:
        return json.dumps({"v": VERSION, **asdict(self)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls: type[M], payload: bytes) -> M:
        body = _json_object(payload)
        values = {}
        for f in fields(cls):
            if f.name not in body:
                if f.name in cls._optional:
                    continue
                raise WireError("bad_message", f"{cls.__name__}: missing field {f.name!r}")
            values[f.name] = _typed(cls.__name__, f.name, body[f.name], f.type)
        return cls(**values)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _json_object(payload: bytes) -> dict[str, Any]:
    try:
        body = json.loads(bytes(payload).decode("utf-8"), parse_float=_finite, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError("bad_message", f"not UTF-8 JSON: {e}") from None
    if not isinstance(body, dict):
        raise WireError("bad_message", "a message must be a JSON object")
    if body.get("v") != VERSION:
        raise WireError("bad_message", f"unsupported protocol version {body.get('v')!r}, this peer speaks {VERSION}")
    return body


_TYPES: dict[str, tuple[type, ...]] = {  # field annotation -> accepted JSON value types
    "int": (int,), "float": (int, float), "str": (str,), "dict[str, float]": (dict,), "int | None": (int, type(None)),
}


def _typed(message: str, name: str, value: Any, annotation: Any) -> Any:
    allowed = _TYPES[str(annotation)]
    if isinstance(value, bool) or not isinstance(value, allowed):
        raise WireError("bad_message", f"{message}.{name} must be {annotation}, got {type(value).__name__}")
    if annotation == "dict[str, float]":
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
            raise WireError("bad_message", f"{message}.{name} must map names to numbers")
        return {str(k): float(v) for k, v in value.items()}
    return float(value) if annotation == "float" else value


@dataclass(frozen=True)
class Register(Message):
    """device -> coordinator on .../register/<device> (retained, QoS 1)."""

    n_samples: int
    base_digest: str
    software: str


@dataclass(frozen=True)
class RoundInfo(Message):
    """coordinator -> all on .../round (retained, QoS 1): the open round and where its base model is."""

    round: int
    rounds: int
    state: str  # "open" (train on this base and send an update) or "finished" (the base is the final model)
    deadline: float  # unix seconds
    blob_id: str
    size: int
    sha256: str
    count: int
    base_digest: str


@dataclass(frozen=True)
class UpdateMeta(Message):
    """The `meta` object of every chunk of an update blob."""

    round: int
    n_samples: int
    base_digest: str
    metrics: dict[str, float] = field(default_factory=dict)
    codec: str = "fp32"  # fedper.compression codec of the blob: fp32, fp16, int8 or int8-delta
    _optional: ClassVar[frozenset[str]] = frozenset({"metrics", "codec"})


@dataclass(frozen=True)
class ErrorMessage(Message):
    """coordinator -> device on .../error/<device> (QoS 1, not retained)."""

    code: str
    message: str
    round: int | None = None
    _optional: ClassVar[frozenset[str]] = frozenset({"round"})


# ---------------------------------------------------------------- chunk frames

_PREFIX = struct.Struct(">II")  # header length, crc32 of (header bytes + body)


def encode_frame(header: Mapping[str, Any], body: bytes) -> bytes:
    """u32 header length, u32 crc32 of everything after the prefix (big-endian), JSON header, raw body."""
    head = json.dumps({"v": VERSION, **header}, separators=(",", ":")).encode()
    body = bytes(body)
    return _PREFIX.pack(len(head), zlib.crc32(body, zlib.crc32(head))) + head + body


def decode_frame(payload: bytes) -> tuple[dict[str, Any], bytes]:
    payload = bytes(payload)
    if len(payload) < _PREFIX.size:
        raise WireError("bad_chunk", f"truncated frame: {len(payload)} bytes, shorter than its 8-byte prefix")
    n, crc = _PREFIX.unpack_from(payload)
    if n > MAX_HEADER_SIZE:
        raise WireError("bad_chunk", f"frame header of {n} bytes exceeds {MAX_HEADER_SIZE}")
    if len(payload) < _PREFIX.size + n:
        raise WireError("bad_chunk", f"truncated frame: header says {n} bytes, {len(payload) - _PREFIX.size} present")
    if zlib.crc32(memoryview(payload)[_PREFIX.size :]) != crc:  # a view: no copy of the body
        raise WireError("bad_chunk", "corrupt or truncated frame: crc32 mismatch")
    return _json_object(payload[_PREFIX.size : _PREFIX.size + n]), payload[_PREFIX.size + n :]


@dataclass(frozen=True)
class Chunk:
    blob_id: str
    index: int
    count: int
    size: int  # of the whole blob
    chunk_size: int  # nominal: every chunk but the last holds exactly this many bytes
    sha256: str  # hex, of the whole blob
    meta: dict[str, Any]
    data: bytes

    @property
    def expected_length(self) -> int:
        return min(self.chunk_size, self.size - self.index * self.chunk_size)

    def header(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "data"}


def chunk_count(size: int, chunk_size: int) -> int:
    return max(1, -(-size // chunk_size))


def chunk(
    blob: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE, blob_id: str = "blob", meta: Mapping[str, Any] | None = None
) -> list[bytes]:
    """Split a blob into encoded chunk frames (an empty blob is one empty chunk)."""
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}, got {chunk_size}")
    check_name(blob_id, "blob_id")
    blob = bytes(blob)
    digest = hashlib.sha256(blob).hexdigest()
    count = chunk_count(len(blob), chunk_size)
    frames = []
    for index in range(count):
        data = blob[index * chunk_size : (index + 1) * chunk_size]
        header = Chunk(blob_id, index, count, len(blob), chunk_size, digest, dict(meta or {}), b"")
        frames.append(encode_frame(header.header(), data))
    return frames


def decode_chunk(payload: bytes, *, max_blob_size: int | None = None) -> Chunk:
    """Decode and check one chunk on its own: crc32, fields, ranges and length."""
    header, data = decode_frame(payload)
    try:
        c = Chunk(
            blob_id=header["blob_id"], index=header["index"], count=header["count"], size=header["size"],
            chunk_size=header["chunk_size"], sha256=header["sha256"], meta=header["meta"], data=data,
        )
    except KeyError as e:
        raise WireError("bad_chunk", f"chunk header lacks {e}") from None
    ints = {"index": c.index, "count": c.count, "size": c.size, "chunk_size": c.chunk_size}
    for name, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise WireError("bad_chunk", f"chunk {name} must be a non-negative integer, got {value!r}")
    if not isinstance(c.blob_id, str) or not NAME_RE.match(c.blob_id):
        raise WireError("bad_chunk", f"chunk blob_id {c.blob_id!r} must match {NAME_RE.pattern}")
    if not isinstance(c.sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", c.sha256):
        raise WireError("bad_chunk", "chunk sha256 must be 64 lowercase hex digits")
    if not isinstance(c.meta, dict):
        raise WireError("bad_chunk", "chunk meta must be a JSON object")
    if max_blob_size is not None and c.size > max_blob_size:
        raise WireError("bad_chunk", f"oversized blob: {c.size} bytes declared, the limit is {max_blob_size}")
    if not 1 <= c.chunk_size <= MAX_CHUNK_SIZE:
        raise WireError("bad_chunk", f"chunk_size {c.chunk_size} outside 1..{MAX_CHUNK_SIZE}")
    if c.count != chunk_count(c.size, c.chunk_size) or c.index >= c.count:
        raise WireError(
            "bad_chunk", f"inconsistent chunk: index {c.index}, count {c.count} for {c.size} bytes / {c.chunk_size}"
        )
    if len(c.data) != c.expected_length:
        raise WireError("bad_chunk", f"chunk {c.index} holds {len(c.data)} bytes, expected {c.expected_length}")
    return c


@dataclass
class Blob:
    blob_id: str
    data: bytes
    meta: dict[str, Any]


@dataclass
class _Partial:
    first: Chunk
    parts: dict[int, bytes] = field(default_factory=dict)  # index -> data: memory grows with what arrived


class Reassembler:
    """Collects chunks (in any order) into blobs, per source.

    Memory is bounded: a blob may declare at most `max_blob_size` bytes, and at most
    `max_open_blobs` partial blobs are kept (the least recently fed one is dropped first).
    """

    def __init__(self, max_blob_size: int, max_open_blobs: int = 64) -> None:
        self.max_blob_size = max_blob_size
        self.max_open_blobs = max_open_blobs
        self._open: OrderedDict[tuple[str, str], _Partial] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._open)

    def add(self, source: str, payload: bytes | Chunk) -> Blob | None:
        """The complete blob when this chunk completes it, else None; WireError for a bad chunk."""
        c = payload if isinstance(payload, Chunk) else decode_chunk(payload, max_blob_size=self.max_blob_size)
        if c.size > self.max_blob_size:
            raise WireError("bad_chunk", f"oversized blob: {c.size} bytes declared, the limit is {self.max_blob_size}")
        key = (source, c.blob_id)
        partial = self._open.get(key)
        if partial is None:
            while len(self._open) >= self.max_open_blobs:
                self._open.popitem(last=False)
                self.evicted += 1
            partial = self._open[key] = _Partial(c)
        self._open.move_to_end(key)
        first = partial.first
        if (c.count, c.size, c.chunk_size, c.sha256, c.meta) != (
            first.count, first.size, first.chunk_size, first.sha256, first.meta
        ):
            del self._open[key]
            raise WireError("bad_chunk", f"inconsistent chunk {c.index} of {c.blob_id}: its header differs from chunk "
                            f"{first.index}'s")
        if c.index in partial.parts:
            if partial.parts[c.index] != c.data:
                del self._open[key]
                raise WireError("bad_chunk", f"chunk {c.index} of {c.blob_id} sent twice with different content")
            return None
        partial.parts[c.index] = c.data
        if len(partial.parts) < c.count:
            return None
        del self._open[key]
        data = b"".join(partial.parts[i] for i in range(c.count))  # one copy, into the blob's only buffer
        if hashlib.sha256(data).hexdigest() != c.sha256:
            raise WireError("bad_chunk", f"corrupt blob {c.blob_id}: sha256 mismatch")
        return Blob(c.blob_id, data, c.meta)

    def discard(self, source: str | None = None) -> None:
        """Drop partial blobs (of one source, or all): e.g. when a round closes."""
        for key in [k for k in self._open if source is None or k[0] == source]:
            del self._open[key]


# ---------------------------------------------------------------- parameters


def model_frames(manifest: Manifest, tensors: Mapping[str, np.ndarray], blob_id: str, round_: int,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[bytes, list[bytes]]:
    """(blob, chunk frames) of a base model for a round: the shared tensors only."""
    blob = pack_shared(manifest, tensors)
    return blob, chunk(blob, chunk_size, blob_id, {"round": round_})


def update_frames(manifest: Manifest, tensors: Mapping[str, np.ndarray], meta: UpdateMeta, blob_id: str,
                  chunk_size: int = DEFAULT_CHUNK_SIZE, base: Mapping[str, np.ndarray] | None = None) -> list[bytes]:
    """Chunk frames of a device's update (`update_blob`), each chunk carrying `meta`."""
    fields_ = {k: v for k, v in json.loads(meta.encode()).items() if k != "v"}
    return chunk(update_blob(manifest, tensors, meta.codec, base), chunk_size, blob_id, fields_)


def update_blob(manifest: Manifest, tensors: Mapping[str, np.ndarray], codec: str = "fp32",
                base: Mapping[str, np.ndarray] | None = None) -> bytes:
    """A device's update blob: the shared tensors through `codec`, BatchNorm running statistics
    (not trainable) always exact; `base` is the round's model, which a delta codec encodes against.
    pack_shared runs first in every case: it is what refuses device-local tensors; a compressing
    codec then re-encodes exactly the tensors it accepted."""
    blob = pack_shared(manifest, tensors)
    if codec == "fp32":
        return blob
    shared = manifest.shared_tensors
    return compression.pack({t.name: tensors[t.name] for t in shared}, codec,
                            exact={t.name for t in shared if not t.trainable}, reference=base)


def decode_tensors(manifest: Manifest, blob: bytes, codec: str | None = None,
                   base: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The blob's shared tensors, decompressed when it says so (`fedper.codec` in its metadata) and
    validated against the manifest (layout, dtype, shape, NaN/Inf); any refusal is
    WireError("bad_tensors"). `codec`, when given, is what the sender announced: it must match.
    `base`: the round's model, for an update whose codec encodes the difference from it."""
    try:
        blob_codec = compression.codec_of(blob)
        if codec is not None and codec != blob_codec:
            raise WireError("bad_tensors", f"the update announces codec {codec!r}, its blob is {blob_codec!r}")
        if blob_codec == "fp32":
            return unpack_shared(manifest, blob)
        _, tensors = compression.unpack(blob, base)
        check_shared(manifest, tensors, what="unpack")
        return {t.name: tensors[t.name] for t in manifest.shared_tensors}
    except (TensorError, compression.CodecError) as e:
        raise WireError("bad_tensors", str(e)) from None


def decode_update_meta(meta: Mapping[str, Any]) -> UpdateMeta:
    return UpdateMeta.decode(json.dumps({"v": VERSION, **meta}).encode())


def max_shared_blob_size(manifest: Manifest) -> int:
    """An upper bound for pack_shared's output: data bytes plus generous room for the safetensors header."""
    data = sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize for t in manifest.shared_tensors)
    return data + 256 * len(manifest.shared_tensors) + 4096
