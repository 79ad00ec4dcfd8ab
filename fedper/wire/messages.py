"""Protocol v1's JSON messages (docs/protocol.md, sections 4 and 6): frozen dataclasses whose type hints,
read with typing.get_type_hints, declare every bound a receiver checks before it acts on a message. The bounds
sit beside the fields (Annotated[int, Int(1)], Literal choices, Optional), not in a validator that knows the
fields' names, so a new field cannot go unchecked and `X | None` is checked as X or null."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from fedper.wire.topics import NAME_RE, VERSION, WireError

# Bounds every field is checked against before a receiver acts on a message (docs/protocol.md, section 4).
MAX_JSON_INT = 2**53 - 1  # the largest integer every JSON parser holds exactly (IEEE doubles, as JavaScript's)
MAX_TEXT = 256  # characters of a string field (an error's message: MAX_ERROR_TEXT)
MAX_ERROR_TEXT = 4096
MAX_METRICS = 16  # entries of an update's metrics, each named like a topic level (NAME_RE)
MAX_METRIC_VALUE = 1e15  # |value| of a metric: a fleet's sum of them stays a finite float
MAX_LOCAL_EPOCHS = 1_000  # local epochs a coordinator may ask of a device in one round
MAX_BATCH_SIZE = 65_536  # the batch size it may ask
SHA256_HEX = re.compile(r"[0-9a-f]{64}")

M = TypeVar("M", bound="Message")


# ---------------------------------------------------------------- constraints, as Annotated metadata


@dataclass(frozen=True)
class Int:
    """An integer field's range (an unannotated int: 0..MAX_JSON_INT)."""

    low: int = 0
    high: int = MAX_JSON_INT


@dataclass(frozen=True)
class Text:
    """A string field's length and the pattern it must match in full (an unannotated str: MAX_TEXT, any)."""

    max_length: int = MAX_TEXT
    pattern: re.Pattern[str] | None = None


@dataclass(frozen=True)
class Entries:
    """A secure-aggregation map's or list's number of entries, and each value's size in bytes in a map."""

    max_items: int
    size: int = 0


@dataclass(frozen=True)
class Bytes:
    """A secure-aggregation byte string of exactly `size` bytes, base64 with padding (RFC 4648, 4) on the wire."""

    size: int


@dataclass(frozen=True)
class Required:
    """A field that must be on the wire although it has a default (a stage message's `stage`): the other
    fields with a default may be left out."""


# ---------------------------------------------------------------- messages


@dataclass(frozen=True)
class Message:
    """A JSON object message. Unknown fields are ignored; a missing, mistyped or out-of-range field is an
    error: every field is checked (type, range, length, number of entries) before a receiver sees it."""

    def to_dict(self) -> dict[str, Any]:
        """The message's fields as JSON values (without "v", which belongs to the JSON message's framing)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls: type[M], body: Mapping[str, Any]) -> M:
        """The message from a parsed JSON object, each field checked; WireError("bad_message") otherwise."""
        if not isinstance(body, Mapping):
            raise WireError("bad_message", f"{cls.__name__} must be a JSON object, got {type(body).__name__}")
        values = {}
        for name, optional, check in _schema(cls):
            if name not in body:
                if optional:
                    continue
                raise WireError("bad_message", f"{cls.__name__}: missing field {name!r}")
            values[name] = check(f"{cls.__name__}.{name}", body[name])
        return cls(**values)

    def encode(self) -> bytes:
        return json.dumps({"v": VERSION, **self.to_dict()}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls: type[M], payload: bytes) -> M:
        return cls.from_dict(json_object(payload))


Check = Callable[[str, Any], Any]  # (the field's name for an error, the received value) -> the checked value


@cache
def _schema(cls: type[Message]) -> tuple[tuple[str, bool, Check], ...]:
    """(name, may be left out, check) for each field of a message class, from its resolved type hints."""
    hints = get_type_hints(cls, include_extras=True)
    schema = []
    for f in fields(cls):
        hint = hints[f.name]
        required = get_origin(hint) is Annotated and any(isinstance(e, Required) for e in get_args(hint)[1:])
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        schema.append((f.name, has_default and not required, _check(hint, f"{cls.__name__}.{f.name}")))
    return tuple(schema)


def _check(hint: Any, where: str) -> Check:
    """The check of a value against a type hint and its Annotated constraint; TypeError for a hint the wire
    has no JSON form for (a message defined wrongly, found when its class is first decoded)."""
    constraint = None
    if get_origin(hint) is Annotated:
        hint, *extras = get_args(hint)
        constraint = next((e for e in extras if not isinstance(e, Required)), None)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = _check(next(a for a in args if a is not type(None)), where)
        return lambda name, value: None if value is None else inner(name, value)
    if hint is int:
        bounds = constraint or Int()
        return lambda name, value: _integer(name, value, bounds)
    if hint is float:
        return _number
    if hint is str:
        text = constraint or Text()
        return lambda name, value: _text(name, value, text, None)
    if origin is Literal and all(isinstance(a, str) for a in args):
        return lambda name, value: _text(name, value, Text(), args)
    if hint == dict[str, float]:
        return _metrics
    if hint is bytes and isinstance(constraint, Bytes):
        return lambda name, value: _bytes(name, value, constraint.size)
    if hint == dict[int, bytes] and isinstance(constraint, Entries):
        return lambda name, value: _index_map(name, value, constraint)
    if origin is list and isinstance(constraint, Entries) and len(args) == 1:
        item = get_args(args[0])
        if get_origin(args[0]) is Annotated and item[0] is int and isinstance(item[1], Int):
            return lambda name, value: _int_list(name, value, constraint, item[1])
        if get_origin(args[0]) is Annotated and item[0] is str and isinstance(item[1], Text):
            return lambda name, value: _text_list(name, value, constraint, item[1])
    raise TypeError(f"{where}: no wire type for {hint!r} with {constraint!r}")


def _plain(value: Any) -> Any:
    """A field's JSON value: bytes as base64, a map's keys as strings (a device's index in secure aggregation)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return {str(key): _plain(v) for key, v in value.items()} if isinstance(value, dict) else value


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def json_object(payload: bytes) -> dict[str, Any]:
    """A JSON object of protocol version VERSION (a message, or a chunk frame's header); WireError otherwise."""
    try:
        body = json.loads(bytes(payload).decode("utf-8"), parse_float=_finite, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError("bad_message", f"not UTF-8 JSON: {e}") from None
    if not isinstance(body, dict):
        raise WireError("bad_message", "a message must be a JSON object")
    version = body.get("v")
    if not is_int(version) or version != VERSION:
        raise WireError("bad_message", f"unsupported protocol version {shown(version)}, this peer speaks {VERSION}")
    return body


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shown(value: Any) -> str:
    """A received value for an error message, never longer than a line (it may be a 10**400 or a deep list)."""
    if is_int(value) and not -MAX_JSON_INT <= value <= MAX_JSON_INT:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(name: str, value: Any, bounds: Int) -> int:
    if not is_int(value) or not bounds.low <= value <= bounds.high:
        raise WireError("bad_message", f"{name} must be an integer in {bounds.low}..{bounds.high}, got {shown(value)}")
    return value


def _number(name: str, value: Any, limit: float = math.inf) -> float:
    """A JSON number as a finite float of magnitude <= limit (an integer like 10**400 is not one)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise WireError("bad_message", f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and abs(number) <= limit):
        raise WireError("bad_message", f"{name} must be a finite number of magnitude <= {limit:g}, got {shown(value)}")
    return number


def _text(name: str, value: Any, text: Text, choices: tuple[str, ...] | None) -> str:
    if not isinstance(value, str) or len(value) > text.max_length:
        raise WireError("bad_message", f"{name} must be a string of at most {text.max_length} characters, got "
                        f"{shown(value) if not isinstance(value, str) else f'{len(value)} characters'}")
    if (text.pattern is not None and not text.pattern.fullmatch(value)) or (choices and value not in choices):
        wanted = " or ".join(choices) if choices else f"like {text.pattern.pattern}"  # type: ignore[union-attr]
        raise WireError("bad_message", f"{name} {shown(value)} must be {wanted}")
    return value


def _metrics(name: str, value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) > MAX_METRICS:
        raise WireError("bad_message", f"{name} must be an object of at most {MAX_METRICS} numbers, got "
                        f"{len(value) if isinstance(value, dict) else type(value).__name__}")
    for key in value:
        if not isinstance(key, str) or not NAME_RE.fullmatch(key):
            raise WireError("bad_message", f"{name}: name {shown(key)} must match {NAME_RE.pattern}")
    return {key: _number(f"{name}.{key}", v, MAX_METRIC_VALUE) for key, v in value.items()}


_INDEX = re.compile(r"0|[1-9][0-9]{0,5}")  # a device's index in a secure-aggregation round, as an object key


def _bytes(name: str, value: Any, size: int) -> bytes:
    """Base64 of exactly `size` bytes, as those bytes."""
    if isinstance(value, str) and len(value) == 4 * math.ceil(size / 3):
        try:
            data = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            data = b""
        if len(data) == size:
            return data
    raise WireError("bad_message", f"{name} must be base64 of {size} bytes")


def _index_map(name: str, value: Any, entries: Entries) -> dict[int, bytes]:
    """An index -> base64 map (secure aggregation), as index -> bytes."""
    if not isinstance(value, dict) or len(value) > entries.max_items:
        raise WireError("bad_message", f"{name} must be an object of at most {entries.max_items} strings, got "
                        f"{len(value) if isinstance(value, dict) else type(value).__name__}")
    for key in value:
        if not _INDEX.fullmatch(key):
            raise WireError("bad_message", f"{name}: key {shown(key)} must be a device index, {_INDEX.pattern}")
    return {int(key): _bytes(f"{name}.{key}", text, entries.size) for key, text in value.items()}


def _int_list(name: str, value: Any, entries: Entries, bounds: Int) -> list[int]:
    if not isinstance(value, list) or len(value) > entries.max_items:
        raise WireError("bad_message", f"{name} must be a list of at most {entries.max_items} integers")
    if not all(is_int(v) and bounds.low <= v <= bounds.high for v in value):
        raise WireError("bad_message", f"{name} must hold integers in {bounds.low}..{bounds.high}")
    return list(value)


def _text_list(name: str, value: Any, entries: Entries, text: Text) -> list[str]:
    if not isinstance(value, list) or len(value) > entries.max_items:
        raise WireError("bad_message", f"{name} must be a list of at most {entries.max_items} strings")
    return [_text(f"{name}[{i}]", v, text, None) for i, v in enumerate(value)]


Positive = Annotated[int, Int(1)]


@dataclass(frozen=True)
class Register(Message):
    """device -> coordinator on .../register/<device> (retained, QoS 1)."""

    n_samples: Positive
    base_digest: str
    software: str


@dataclass(frozen=True)
class RoundInfo(Message):
    """coordinator -> all on .../round (retained, QoS 1): the open round and where its base model is."""

    round: Positive
    rounds: Positive
    state: Literal["open", "finished"]  # "open": train on this base and send an update; "finished": the final model
    deadline: float  # unix seconds
    blob_id: Annotated[str, Text(pattern=NAME_RE)]
    size: int
    sha256: Annotated[str, Text(pattern=SHA256_HEX)]
    count: Positive
    base_digest: str
    selection: Literal["all", "invited"] = "all"  # "all": every registered device takes part; "invited": only
    # those invited on .../invite/<device> for this round
    next_selection_at: float | None = None  # unix seconds: when the next round's invitations are made, at the latest
    secagg_session: Positive | None = None  # secure aggregation: the session a device advertises its keys for (a
    # new one after a failed or restarted session); None: clear updates
    max_staleness: int | None = None  # asynchronous rounds: updates trained on rounds round - max_staleness ..
    # round are taken (a device sends its update for the round it trained on after a newer one opened); None: only
    # this round's
    # The round's local training, decided by the coordinator for its whole fleet (--lr with its schedule,
    # --local-epochs, --batch-size); left out: each device trains with its own flags (docs/protocol.md)
    lr: float | None = None  # > 0 (a device ignores a RoundInfo with another)
    local_epochs: Annotated[int, Int(1, MAX_LOCAL_EPOCHS)] | None = None
    batch_size: Annotated[int, Int(1, MAX_BATCH_SIZE)] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Optional fields at their default are not sent: with every device taking part, RoundInfo is what it
        was before selection existed."""
        body = super().to_dict()
        for name, default in (("selection", "all"), ("next_selection_at", None), ("secagg_session", None),
                              ("max_staleness", None), ("lr", None), ("local_epochs", None), ("batch_size", None)):
            if body[name] == default:
                del body[name]
        return body


@dataclass(frozen=True)
class Invitation(Message):
    """coordinator -> one device on .../invite/<device> (retained, QoS 1; cleared when its round closes):
    take part in `round` (its deadline and model are in RoundInfo). Its size does not depend on the fleet's."""

    round: Positive


@dataclass(frozen=True)
class UpdateMeta(Message):
    """The `meta` object of every chunk of an update blob."""

    round: int
    n_samples: Positive
    base_digest: str
    metrics: dict[str, float] = field(default_factory=dict)
    codec: str = "fp32"  # fedper.compression.CODECS: the codec of the blob


@dataclass(frozen=True)
class ErrorMessage(Message):
    """coordinator -> device on .../error/<device> (QoS 1, not retained)."""

    code: str
    message: Annotated[str, Text(MAX_ERROR_TEXT)]
    round: int | None = None


# ---------------------------------------------------------------- secure aggregation (docs/protocol.md, 6.9)

SECAGG_CODEC = "secagg"  # UpdateMeta.codec of a masked input: a safetensors blob of one U32 tensor
MAX_SECAGG_DEVICES = 10_000  # devices in one secure-aggregation session (indices 0..n-1): the consistency check
# sends each device the signatures of more than half of them
MAX_SECAGG_NEIGHBOURS = 1_000  # k: entries of a stage message's index -> base64 map of neighbours
# Sizes of the byte strings a stage message carries (base64 on the wire; docs/protocol.md, 6.9). fedper.secagg
# makes and reads them; tests/test_secagg.py checks them against its primitives.
KEY_BYTES = 32  # an X25519 or Ed25519 public key
SIGNATURE_BYTES = 64  # an Ed25519 signature
SHARE_BYTES = 66  # a Shamir share: an element of the field mod 2**521 - 1, big-endian
SEALED_SHARE_BYTES = 168  # a 12-byte nonce || the AES-GCM ciphertext of (sender, receiver, two shares) and its tag
ADVERT_BYTES = 3 * KEY_BYTES + 2 * SIGNATURE_BYTES  # c, s, identity keys; the certificate; the keys' signature
SIGNER_BYTES = KEY_BYTES + 2 * SIGNATURE_BYTES  # identity key, its certificate, its signature of the survivors

Key = Annotated[bytes, Bytes(KEY_BYTES)]
Signature = Annotated[bytes, Bytes(SIGNATURE_BYTES)]
Index = Annotated[int, Int(0, MAX_SECAGG_DEVICES - 1)]
Indices = Annotated[list[Index], Entries(MAX_SECAGG_NEIGHBOURS)]  # some of a device's neighbours
Survivors = Annotated[list[Index], Entries(MAX_SECAGG_DEVICES)]  # some of the session's devices
Shares = Annotated[dict[int, bytes], Entries(MAX_SECAGG_NEIGHBOURS, SHARE_BYTES)]  # index -> a share, k at most


@dataclass(frozen=True)
class SecAggAdvertise(Message):
    """device -> coordinator on .../secagg/<device>: stage 1, the device's two public keys for the session, signed
    by its identity key (Ed25519), with that key and the fleet root's certificate of it (docs/privacy.md)."""

    round: Positive
    session: Positive
    c_public: Key
    s_public: Key
    identity: Key
    certificate: Signature
    signature: Signature
    stage: Annotated[Literal["advertise"], Required()] = "advertise"


@dataclass(frozen=True)
class SecAggNeighbours(Message):
    """coordinator -> device on .../relay/<device>: the session's setup (the kernel's SecAggConfig: the roster of
    device names by index, the groups summed apart), the device's index, the weight scale, and its advertising
    neighbours' signed adverts (index -> base64). With distributed DP: the device's noise, its uniform weight and
    the trainable tensors only (docs/privacy.md)."""

    round: Positive
    session: Positive
    roster: Annotated[list[Annotated[str, Text(64, NAME_RE)]], Entries(MAX_SECAGG_DEVICES)]
    groups: Annotated[list[Annotated[int, Int(2, MAX_SECAGG_DEVICES)]], Entries(MAX_SECAGG_DEVICES // 2)]
    index: Index
    length: Positive
    clip: float
    degree: Annotated[int, Int(1, MAX_SECAGG_NEIGHBOURS)]
    threshold: Annotated[int, Int(1, MAX_SECAGG_NEIGHBOURS)]
    value_bits: Annotated[int, Int(1, 32)]
    graph_seed: int
    weight_scale: Positive  # a device sends (n_j / weight_scale) * its clipped delta
    adverts: Annotated[dict[int, bytes], Entries(MAX_SECAGG_NEIGHBOURS, ADVERT_BYTES)]
    stage: Annotated[Literal["neighbours"], Required()] = "neighbours"
    clip_norm: float | None = None  # the L2 bound of a delta when it is below `clip` (the quantization range)
    noise_std: float = 0.0  # distributed DP: each device adds N(0, noise_std^2) to each value before quantizing
    weights: Literal["samples", "uniform"] = "samples"  # uniform: DP-FedAvg's
    tensors: Literal["shared", "trainable"] = "shared"  # which ones are summed (fedper.manifest.Manifest.summed)


@dataclass(frozen=True)
class SecAggShares(Message):
    """Stage 2, index -> base64(nonce || AES-GCM ciphertext). device -> coordinator on .../secagg/<device>:
    its shares, keyed by receiver; coordinator -> device on .../relay/<device>: those addressed to it, keyed by
    sender."""

    round: Positive
    session: Positive
    shares: Annotated[dict[int, bytes], Entries(MAX_SECAGG_NEIGHBOURS, SEALED_SHARE_BYTES)]
    stage: Annotated[Literal["shares"], Required()] = "shares"


@dataclass(frozen=True)
class SecAggReceived(Message):
    """device -> coordinator on .../secagg/<device>: the relayed shares are in; `skipped`: the senders whose share
    did not authenticate (the device masks with none of them)."""

    round: Positive
    session: Positive
    skipped: Indices
    stage: Annotated[Literal["received"], Required()] = "received"


@dataclass(frozen=True)
class SecAggMask(Message):
    """coordinator -> device on .../relay/<device>: send the masked input, masking with none of `excluded` (its
    neighbours that another device reported)."""

    round: Positive
    session: Positive
    excluded: Indices
    stage: Annotated[Literal["mask"], Required()] = "mask"


@dataclass(frozen=True)
class SecAggSurvivors(Message):
    """coordinator -> device on .../relay/<device>: the consistency check, the devices whose masked inputs are
    summed (U3 in Bonawitz et al.), for the device to sign."""

    round: Positive
    session: Positive
    survivors: Survivors
    stage: Annotated[Literal["consistency"], Required()] = "consistency"


@dataclass(frozen=True)
class SecAggSignature(Message):
    """device -> coordinator on .../secagg/<device>: its identity's signature of the setup and the survivors."""

    round: Positive
    session: Positive
    signature: Signature
    stage: Annotated[Literal["consistency"], Required()] = "consistency"


@dataclass(frozen=True)
class SecAggUnmaskRequest(Message):
    """coordinator -> device on .../relay/<device>: stage 4, with the signatures of more than half of the session on
    the survivors (index -> base64(identity || certificate || signature)); the device reveals, for each neighbour it
    masked with, the self-mask share of a survivor or the key share of one that is not."""

    round: Positive
    session: Positive
    signatures: Annotated[dict[int, bytes], Entries(MAX_SECAGG_DEVICES, SIGNER_BYTES)]
    stage: Annotated[Literal["unmask"], Required()] = "unmask"


@dataclass(frozen=True)
class SecAggUnmask(Message):
    """device -> coordinator on .../secagg/<device>: stage 4, the requested shares (index -> base64)."""

    round: Positive
    session: Positive
    seed_shares: Shares
    key_shares: Shares
    stage: Annotated[Literal["unmask"], Required()] = "unmask"


SECAGG_UP: dict[str, type[Message]] = {"advertise": SecAggAdvertise, "shares": SecAggShares,
                                       "received": SecAggReceived, "consistency": SecAggSignature,
                                       "unmask": SecAggUnmask}
SECAGG_DOWN: dict[str, type[Message]] = {"neighbours": SecAggNeighbours, "shares": SecAggShares, "mask": SecAggMask,
                                         "consistency": SecAggSurvivors, "unmask": SecAggUnmaskRequest}


def decode_secagg(payload: bytes, kinds: Mapping[str, type[M]]) -> M:
    """A secure-aggregation stage message (SECAGG_UP or SECAGG_DOWN, by its `stage`), every field checked."""
    body = json_object(payload)
    stage = body.get("stage")
    if not isinstance(stage, str) or stage not in kinds:
        raise WireError("bad_message", f"stage {shown(stage)} must be one of {', '.join(kinds)}")
    return kinds[stage].from_dict(body)


def decode_update_meta(meta: Mapping[str, Any]) -> UpdateMeta:
    """The `meta` object of an update chunk, every field checked (it came parsed in the chunk's header)."""
    return UpdateMeta.from_dict(meta)
