"""Upload intake: per-device quotas, the reassembly of chunked updates and their refusals.

Everything here is checked before an upload costs memory (docs/reliability.md, "Untrusted devices"): the
message rate (coordinator/quota.py, also applied in paho's network thread), the update blobs a device may
start in a round's attempt, and the update's meta against the device's registration and the open round.
A blob refused once is remembered, so that its later chunks are dropped unanswered: one answer per blob.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from fedper.coordinator.config import Quotas
from fedper.coordinator.logs import log
from fedper.coordinator.quota import BURST_SECONDS, MessageRateLimit
from fedper.coordinator.store import Registration
from fedper.wire import (
    Chunk,
    ErrorMessage,
    Outgoing,
    Reassembler,
    Topics,
    UpdateMeta,
    WireError,
    chunk_count,
    decode_update_meta,
)

MAX_REJECTED_PER_DEVICE = 1_000  # refused blob ids remembered per device (its later chunks are dropped unanswered)
MAX_REJECTED_DEVICES = 10_000
DEFAULT_REASSEMBLY_BYTES = 1 << 30  # all devices' partial uploads together, unless 4 devices' quotas are more


class Resent(WireError):
    """An update this coordinator already accepted, sent again (a device resends at every RoundInfo it sees
    again: docs/protocol.md calls it harmless): refused and counted as before, but no warning."""


class Intake:
    """The quotas and partial uploads of the open round's attempt."""

    def __init__(self, quotas: Quotas, chunk_size: int, blob: int, topics: Topics) -> None:
        self.quotas, self.topics = quotas, topics
        self.reassembler, self.rate = sized(quotas, chunk_size, blob)
        self._rejected: dict[str, set[str]] = {}  # device -> blob ids refused (and answered) in the open round
        self._metas: dict[str, tuple[str, bytes, UpdateMeta]] = {}  # device -> its blob's checked meta, this round
        self._started: dict[str, set[str]] = {}  # device -> update blob ids it started in this round's attempt
        self._muted: set[str] = set()  # devices past --max-uploads-per-round in this attempt

    def admit(self, device: str, kind: str, now: float) -> bool:
        return self.rate.admit(device, now, upload=kind == "update")

    def muted(self, device: str) -> bool:
        return device in self._muted

    def refused(self, device: str, blob_id: str) -> bool:
        """A blob refused (and answered) once already: its other chunks are dropped."""
        return blob_id in self._rejected.get(device, ())

    def check(self, device: str, frame: Chunk, registration: Registration | None, open_round: int,
              round_checks: Callable[[UpdateMeta], None]) -> UpdateMeta:
        """The upload's quota, its device's registration, its meta (decoded once per blob), then `round_checks`
        (the open round's: its number, the invitation, the export), then its sample count; WireError if not."""
        self._start_upload(device, frame.blob_id, open_round)
        if registration is None:
            raise WireError("unknown_device", f"{device} has not registered: publish register/{device} first")
        meta = self._meta(device, frame)
        round_checks(meta)
        if meta.n_samples > self.quotas.max_samples_per_device:  # registered under a higher cap earlier
            raise WireError("too_many_samples", f"n_samples {meta.n_samples} is above --max-samples-per-device "
                            f"{self.quotas.max_samples_per_device}")
        if meta.n_samples != registration.n_samples:
            raise WireError("n_samples_mismatch", f"the update claims {meta.n_samples} samples, {device} "
                            f"registered {registration.n_samples}: re-register, then resend")
        return meta

    def refuse(self, device: str, blob_id: str) -> None:
        """The blob is refused as a whole: its partial upload is dropped, its later chunks too. Remembered per
        device, so that one device's flood of refused blobs never makes another's be answered twice."""
        if device not in self._rejected and len(self._rejected) >= MAX_REJECTED_DEVICES:
            self._rejected.clear()
        refused = self._rejected.setdefault(device, set())
        if len(refused) >= MAX_REJECTED_PER_DEVICE:
            refused.clear()
        refused.add(blob_id)
        self.reassembler.discard(device)

    def new_attempt(self) -> None:
        """A round (or a new attempt at it) opens: upload quotas start afresh."""
        self._started.clear()
        self._muted.clear()
        self.rate.unmute_all()

    def new_round(self, finished: bool, takes: Callable[[UpdateMeta], bool]) -> None:
        """A round opened: drop the partial uploads it does not take (every one after a synchronous round; a
        buffered round still takes those for earlier rounds, which a release must not cost their devices)."""
        self._rejected.clear()
        self.new_attempt()
        if finished:
            self._metas.clear()
            self.reassembler.discard()
            return
        for device, (_, _, meta) in list(self._metas.items()):
            if not takes(meta):
                del self._metas[device]
                self.reassembler.discard(device)

    def rate_limited(self, now: float, open_round: int) -> tuple[Counter[str], list[Outgoing]]:
        """Messages dropped unread since the last call (here or by `admit` in the service's network thread), by
        code; an answer per device once per report window. Uploads of a muted device count as over_quota (the
        device was answered when it was muted)."""
        counts: Counter[str] = Counter({"over_quota": sum(self.rate.take_muted().values())})
        out = []
        for device, count in self.rate.take_dropped().items():
            counts["rate_limited"] += count
            dropped = self.rate.report_due(device, now)
            if dropped:
                message = (f"dropped {dropped} message(s) unread since the last report: above "
                           f"--max-messages-per-second {self.quotas.max_messages_per_second:g}")
                log.warning("rate_limited %s: %s", device, message)
                out.append(Outgoing(self.topics.error(device),
                                    ErrorMessage("rate_limited", message, open_round).encode()))
        return +counts, out

    def _start_upload(self, device: str, blob_id: str, open_round: int) -> None:
        """Count the update blobs (any blob id, refused ones too) the device started in this attempt of the
        round; past --max-uploads-per-round it is answered once and muted: its uploads are dropped unread (by
        `admit` in the network thread, in `muted` for those admitted before) until the next attempt. A device
        opening uploads it never finishes then costs a set lookup a message, not a decode."""
        started = self._started.setdefault(device, set())
        if blob_id in started:
            return
        quota = self.quotas.max_uploads_per_round
        if len(started) >= quota:
            self._muted.add(device)
            self.rate.mute(device)
            raise WireError("over_quota", f"{device} started {quota} update blobs in round {open_round} "
                            f"(--max-uploads-per-round): its update messages are dropped until the next round")
        started.add(blob_id)

    def _meta(self, device: str, frame: Chunk) -> UpdateMeta:
        """The chunk's meta, every field checked (types, ranges, metrics' names and values): once per blob, as
        every chunk of a blob repeats its meta (the reassembler refuses one that differs), not once per chunk."""
        blob_id, raw, meta = self._metas.get(device, (None, None, None))
        if meta is None or blob_id != frame.blob_id or raw != frame.meta:
            meta = decode_update_meta(frame.meta)
            self._metas[device] = (frame.blob_id, frame.meta, meta)
        return meta


def sized(quotas: Quotas, chunk_size: int, blob: int) -> tuple[Reassembler, MessageRateLimit]:
    """Per-device quotas: in-flight uploads, their bytes and the message rate, each sized so that an honest
    device's upload (`blob` bytes) always fits."""
    per_device = quotas.max_upload_bytes_per_device or 2 * blob + Reassembler.PARTIAL_COST
    everyone = quotas.max_reassembly_bytes or max(DEFAULT_REASSEMBLY_BYTES, 4 * per_device)
    if per_device < blob or everyone < per_device:
        raise ValueError(f"--max-upload-bytes-per-device ({per_device}) must hold one update of the model "
                         f"({blob} bytes) and --max-reassembly-bytes ({everyone}) one device's quota")
    reassembler = Reassembler(blob, quotas.max_open_blobs, max_blobs_per_source=quotas.max_uploads_per_device,
                              max_bytes_per_source=per_device, max_bytes=everyone)
    upload = chunk_count(blob, chunk_size)  # messages of one update at the coordinator's chunk size
    rate = quotas.max_messages_per_second
    return reassembler, MessageRateLimit(rate, burst=max(BURST_SECONDS * rate, 2 * upload + 16))
