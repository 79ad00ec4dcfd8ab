"""Wire protocol v1 (docs/protocol.md), pure (bytes in, bytes out) so the coordinator, the agent and the fuzz
tests share one implementation: `topics` names things, `messages` are the JSON messages with their bounds,
`chunks` cuts a blob into frames and puts it back together. Parameters are not its business: a blob of them is
made and checked by `fedper.payload`, which refuses device-local tensors (the head cannot be encoded, so it
cannot be sent). Everything public is importable from `fedper.wire` itself."""

from fedper.wire.chunks import (
    DEFAULT_CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    MAX_HEADER_SIZE,
    Blob,
    Chunk,
    Reassembler,
    chunk,
    chunk_count,
    decode_chunk,
    decode_frame,
    encode_frame,
)
from fedper.wire.messages import (
    KEY_B64,
    MAX_ERROR_TEXT,
    MAX_JSON_INT,
    MAX_METRIC_VALUE,
    MAX_METRICS,
    MAX_SECAGG_DEVICES,
    MAX_SECAGG_NEIGHBOURS,
    MAX_TEXT,
    PAIR_B64,
    SEALED_SHARE_B64,
    SECAGG_CODEC,
    SECAGG_DOWN,
    SECAGG_UP,
    Entries,
    ErrorMessage,
    Int,
    Invitation,
    Message,
    Register,
    Required,
    RoundInfo,
    SecAggAdvertise,
    SecAggNeighbours,
    SecAggShares,
    SecAggUnmask,
    SecAggUnmaskRequest,
    Text,
    UpdateMeta,
    decode_secagg,
    decode_update_meta,
)
from fedper.wire.topics import (
    DEVICE_KINDS,
    ERROR_CODES,
    NAME_RE,
    PREFIX,
    VERSION,
    Outgoing,
    Topics,
    WireError,
    check_name,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE", "DEVICE_KINDS", "ERROR_CODES", "KEY_B64", "MAX_CHUNK_SIZE", "MAX_ERROR_TEXT",
    "MAX_HEADER_SIZE", "MAX_JSON_INT", "MAX_METRICS", "MAX_METRIC_VALUE", "MAX_SECAGG_DEVICES",
    "MAX_SECAGG_NEIGHBOURS", "MAX_TEXT", "NAME_RE", "PAIR_B64", "PREFIX", "SEALED_SHARE_B64", "SECAGG_CODEC",
    "SECAGG_DOWN", "SECAGG_UP", "VERSION", "Blob", "Chunk", "Entries", "ErrorMessage", "Int", "Invitation", "Message",
    "Outgoing", "Reassembler", "Register", "Required", "RoundInfo", "SecAggAdvertise", "SecAggNeighbours",
    "SecAggShares", "SecAggUnmask", "SecAggUnmaskRequest", "Text", "Topics", "UpdateMeta", "WireError", "check_name",
    "chunk", "chunk_count", "decode_chunk", "decode_frame", "decode_secagg", "decode_update_meta", "encode_frame",
]
