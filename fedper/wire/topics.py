"""Protocol v1's names: the version, topic levels, error codes and what an engine publishes (docs/protocol.md,
sections 2, 3 and "Errors"). The lowest of the wire's modules: messages and chunks refuse with its WireError."""

from __future__ import annotations

import re
from dataclasses import dataclass

VERSION = 1
PREFIX = f"fedper/v{VERSION}"
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # fleet, device and blob ids: safe in a topic level
DEVICE_KINDS = ("register", "presence", "update", "secagg")  # the topic kinds a device writes

# Error codes sent on .../error/<device> and counted by the coordinator (docs/protocol.md, "Errors").
ERROR_CODES = (
    "bad_message",  # not decodable: bad framing, JSON, missing or mistyped fields, unsupported version
    "bad_chunk",  # corrupt (checksum), truncated, oversized or inconsistent chunk
    "digest_mismatch",  # the device's manifest base_digest is not the coordinator's
    "unknown_device",  # an update from a device that has not registered
    "late_update",  # an update for a round that is not the open one
    "stale_update",  # asynchronous rounds: an update trained on a round older than the open one's max_staleness
    "duplicate_update",  # a second update for a round already accepted from this device
    "bad_tensors",  # wrong names, shapes or dtypes, NaN or Inf
    "rejected",  # a well-formed update the aggregation rule refused
    "too_many_samples",  # a registration (or update) claims more samples than the coordinator's per-device cap
    "n_samples_mismatch",  # an update's n_samples is not what its device registered
    "internal_error",  # the coordinator failed on the message (a bug): refused, answered, logged once
    "over_quota",  # the chunk would pass the sender's or the coordinator's reassembly quota (Reassembler)
    "rate_limited",  # the sender's messages were dropped unread: above its message rate (coordinator/quota.py)
    "not_invited",  # an update from a device the open round did not invite (--clients-per-round): not reassembled
    "secagg",  # a secure-aggregation message out of its stage or session, or refused by the protocol; or a clear
    # update where the round runs secure aggregation
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

    def invite(self, device: str) -> str:
        return f"{self.base}/invite/{check_name(device, 'device')}"

    def secagg(self, device: str) -> str:
        """device -> coordinator: the device's secure-aggregation stage messages (docs/protocol.md, 6.9)."""
        return f"{self.base}/secagg/{check_name(device, 'device')}"

    def relay(self, device: str) -> str:
        """coordinator -> one device: its secure-aggregation stage messages (neighbours' keys, shares, unmask)."""
        return f"{self.base}/relay/{check_name(device, 'device')}"

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
        if len(parts) != 5 or "/".join(parts[:3]) != self.base or parts[3] not in DEVICE_KINDS:
            raise WireError("bad_message", f"not a device topic of fleet {self.fleet}: {topic}")
        return parts[3], check_name(parts[4], "device")


@dataclass(frozen=True)
class Outgoing:
    """A message an engine wants published; the MQTT service around it does the I/O."""

    topic: str
    payload: bytes
    retain: bool = False
    qos: int = 1
    broadcast: bool = False  # part of a round's model broadcast (timed by the coordinator's service)
