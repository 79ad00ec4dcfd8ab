"""Protocol bytes written by hand from docs/protocol.md (json text, struct, zlib, hashlib), never with
fedper.wire's or fedper.payload's encoders: attack tests build their hostile frames with these, so a
bug shared by the project's encoder and decoder cannot hide."""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from typing import Any

import numpy as np


class Raw(str):
    """A JSON token written as is: numbers no encoder writes (1e400, -0.0e-999, 10**400 in full)."""


def to_json(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)  # any size: json.dumps would too, but say so
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else json.dumps(value)  # Infinity/NaN: not JSON, refused
    return json.dumps(value)


def frame(header: dict[str, Any], body: bytes) -> bytes:
    """Section 5: u32 header length, u32 crc32 of header + data (big-endian), JSON header, data."""
    head = to_json(header).encode()
    return struct.pack(">II", len(head), zlib.crc32(head + body)) + head + body


def safetensors(tensors: dict[str, np.ndarray], header: Any = None) -> bytes:
    """Section 7: u64 little-endian header length, JSON header (padded to 8), row-major little-endian data;
    `header` replaces the honest one (any JSON value)."""
    data, entries, offset = b"", {}, 0
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value, "<f4").tobytes()
        entries[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    text = to_json(entries if header is None else header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def chunks(blob: bytes, meta: Any, blob_id: str = "u1", chunk_size: int = 64,
           header: dict[str, Any] | None = None) -> list[bytes]:
    """An update blob as chunk frames; `header` overrides any header field (out of range, mistyped)."""
    count = max(1, -(-len(blob) // chunk_size))
    digest = hashlib.sha256(blob).hexdigest()
    return [frame({"v": 1, "blob_id": blob_id, "index": i, "count": count, "size": len(blob),
                   "chunk_size": chunk_size, "sha256": digest, "meta": meta, **(header or {})},
                  blob[i * chunk_size : (i + 1) * chunk_size]) for i in range(count)]
