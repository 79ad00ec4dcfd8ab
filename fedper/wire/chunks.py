"""Chunk frames and reassembly (docs/protocol.md, section 5): a blob cut into CRC-checked frames that fit a
broker's message limit, and put back together per sender within quotas, so one sender's flood is its own problem.
A blob's content is not this module's business (fedper.payload makes and checks it)."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fedper.wire.messages import MAX_JSON_INT, SHA256_HEX, is_int, json_object, shown
from fedper.wire.topics import NAME_RE, VERSION, WireError, check_name

# AWS IoT Core caps a message at 128 KB: 63 KiB of data + a <1 KiB header keeps a chunk under 64 KiB.
DEFAULT_CHUNK_SIZE = 63 * 1024
MAX_HEADER_SIZE = 16 * 1024
MAX_CHUNK_SIZE = 1 << 20  # a peer may choose its chunk size, up to this

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
    return json_object(payload[_PREFIX.size : _PREFIX.size + n]), payload[_PREFIX.size + n :]


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
        if not is_int(value) or not 0 <= value <= MAX_JSON_INT:
            raise WireError("bad_chunk", f"chunk {name} must be an integer in 0..{MAX_JSON_INT}, got {shown(value)}")
    if not isinstance(c.blob_id, str) or not NAME_RE.match(c.blob_id):
        raise WireError("bad_chunk", f"chunk blob_id {shown(c.blob_id)} must match {NAME_RE.pattern}")
    if not isinstance(c.sha256, str) or not SHA256_HEX.fullmatch(c.sha256):
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
    sha256: str  # hex, of `data`: checked by the reassembler, so a receiver need not hash it again


@dataclass
class _Partial:
    first: Chunk
    parts: dict[int, bytes] = field(default_factory=dict)  # index -> data: memory grows with what arrived
    cost: int = 0  # bytes charged to its source (Reassembler)


class Reassembler:
    """Collects chunks (in any order) into blobs, per source, within quotas that keep sources apart.

    A blob may declare at most `max_blob_size` bytes. A source holds at most `max_blobs_per_source`
    partial blobs and `max_bytes_per_source` bytes in them: a new blob or chunk beyond either
    displaces that source's own least recently fed partial blobs, never another source's. All
    sources together hold at most `max_open_blobs` partial blobs and `max_bytes` bytes: a newcomer
    that does not fit is refused (`over_quota`) and evicts nobody, so one source's flood is its
    own problem. Bytes are what arrived plus what holding it costs (CHUNK_COST, PARTIAL_COST),
    never what a blob declares.
    """

    CHUNK_COST = 128  # bytes charged per stored chunk beyond its data: a bytes object and a dict slot
    PARTIAL_COST = 4096  # bytes charged per partial blob: its first chunk's header, meta included

    def __init__(self, max_blob_size: int, max_open_blobs: int = 64, *, max_blobs_per_source: int | None = None,
                 max_bytes_per_source: int | None = None, max_bytes: int | None = None) -> None:
        self.max_blob_size = max_blob_size
        self.max_open_blobs = max_open_blobs
        self.max_blobs_per_source = max_blobs_per_source or max_open_blobs
        self.max_bytes_per_source = max_bytes_per_source or 2 * max_blob_size + self.PARTIAL_COST
        self.max_bytes = max_bytes or max_open_blobs * self.max_bytes_per_source
        self._open: dict[str, OrderedDict[str, _Partial]] = {}  # source -> blob_id -> partial, least recent first
        self._source_bytes: dict[str, int] = {}
        self._count = 0  # partial blobs of all sources
        self.bytes = 0  # held by all partial blobs, as charged
        self.evicted = 0  # partial blobs displaced by a newer one of the same source

    def __len__(self) -> int:
        return self._count

    def add(self, source: str, payload: bytes | Chunk) -> Blob | None:
        """The complete blob when this chunk completes it, else None; WireError for a bad chunk,
        `over_quota` for one that does not fit (its blob is dropped)."""
        c = payload if isinstance(payload, Chunk) else decode_chunk(payload, max_blob_size=self.max_blob_size)
        if c.size > self.max_blob_size:
            raise WireError("bad_chunk", f"oversized blob: {c.size} bytes declared, the limit is {self.max_blob_size}")
        blobs = self._open.setdefault(source, OrderedDict())
        partial = blobs.get(c.blob_id)
        if partial is None:
            self._make_room_for_blob(source, blobs)
            partial = blobs[c.blob_id] = _Partial(c)
            self._count += 1
            self._charge(source, partial, self.PARTIAL_COST)
        blobs.move_to_end(c.blob_id)
        first = partial.first
        if (c.count, c.size, c.chunk_size, c.sha256, c.meta) != (
            first.count, first.size, first.chunk_size, first.sha256, first.meta
        ):
            self._drop(source, c.blob_id)
            raise WireError("bad_chunk", f"inconsistent chunk {c.index} of {c.blob_id}: its header differs from chunk "
                            f"{first.index}'s")
        if c.index in partial.parts:
            if partial.parts[c.index] != c.data:
                self._drop(source, c.blob_id)
                raise WireError("bad_chunk", f"chunk {c.index} of {c.blob_id} sent twice with different content")
            return None
        self._make_room_for_bytes(source, c.blob_id, len(c.data) + self.CHUNK_COST)
        partial.parts[c.index] = c.data
        self._charge(source, partial, len(c.data) + self.CHUNK_COST)
        if len(partial.parts) < c.count:
            return None
        self._drop(source, c.blob_id)
        data = b"".join(partial.parts[i] for i in range(c.count))  # one copy, into the blob's only buffer
        if hashlib.sha256(data).hexdigest() != c.sha256:
            raise WireError("bad_chunk", f"corrupt blob {c.blob_id}: sha256 mismatch")
        return Blob(c.blob_id, data, c.meta, c.sha256)

    def _make_room_for_blob(self, source: str, blobs: OrderedDict[str, _Partial]) -> None:
        """Before a source's new blob: displace its own oldest partials while it is at its count, or
        while everyone together is; refuse the blob when the source has none left to give."""
        while blobs and (len(blobs) >= self.max_blobs_per_source or len(self) >= self.max_open_blobs
                         or self.bytes + self.PARTIAL_COST > self.max_bytes):
            self._displace(source, next(iter(blobs)))
        if len(self) >= self.max_open_blobs or self.bytes + self.PARTIAL_COST > self.max_bytes:
            self._forget_if_empty(source)
            raise WireError("over_quota", f"the receiver holds its maximum of partial blobs ({len(self)} blobs, "
                            f"{self.bytes} bytes): try again later")

    def _make_room_for_bytes(self, source: str, blob_id: str, cost: int) -> None:
        """Before storing a chunk: displace the source's own other partials while it or everyone
        together would pass the byte quota; if that is not enough, drop this blob and refuse it."""
        blobs = self._open[source]
        for older in [b for b in blobs if b != blob_id]:
            if not self._over_bytes(source, cost):
                break
            self._displace(source, older)
        if self._over_bytes(source, cost):
            mine, everyone = self._source_bytes.get(source, 0), self.bytes
            self._drop(source, blob_id)
            raise WireError("over_quota", f"blob {blob_id} does not fit the reassembly quota (this device: "
                            f"{mine + cost} of {self.max_bytes_per_source} bytes; everyone: {everyone + cost} of "
                            f"{self.max_bytes}): send larger chunks, or try again later")

    def _over_bytes(self, source: str, cost: int) -> bool:
        return (self._source_bytes.get(source, 0) + cost > self.max_bytes_per_source
                or self.bytes + cost > self.max_bytes)

    def _charge(self, source: str, partial: _Partial, cost: int) -> None:
        partial.cost += cost
        self._source_bytes[source] = self._source_bytes.get(source, 0) + cost
        self.bytes += cost

    def _displace(self, source: str, blob_id: str) -> None:
        self._drop(source, blob_id)
        self.evicted += 1

    def _drop(self, source: str, blob_id: str) -> None:
        partial = self._open[source].pop(blob_id)
        self._count -= 1
        self._source_bytes[source] -= partial.cost
        self.bytes -= partial.cost
        self._forget_if_empty(source)

    def _forget_if_empty(self, source: str) -> None:
        if not self._open.get(source):
            self._open.pop(source, None)
            self._source_bytes.pop(source, None)

    def discard(self, source: str | None = None) -> None:
        """Drop partial blobs (of one source, or all): e.g. when a round closes."""
        for name in [source] if source is not None else list(self._open):
            for blob_id in list(self._open.get(name, ())):
                self._drop(name, blob_id)
