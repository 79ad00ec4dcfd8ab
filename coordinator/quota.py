"""Per-device message rate limit: a token bucket per device, so one device's flood is its own problem.

The one thread-safe part of the coordinator: the service calls `admit` from paho's network thread, so
a flood is dropped as it arrives, and the engine counts and reports the drops (at most once per
REPORT_EVERY_S per device, so a flood cannot become a flood of log lines). The engine may also mute a
device's uploads (it opened more update blobs in a round than --max-uploads-per-round): they are then
dropped here too, unread, until the engine unmutes it. docs/reliability.md.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

REPORT_EVERY_S = 10.0
BURST_SECONDS = 2.0  # a device may send this many seconds' worth of messages at once (an upload's chunks)


@dataclass
class _Bucket:
    tokens: float
    at: float  # when `tokens` was last brought up to date
    dropped: int = 0  # since the last report
    reported_at: float = float("-inf")


class MessageRateLimit:
    """`rate` messages per second per device, in bursts of up to `burst` (default BURST_SECONDS x rate).

    Memory: one small bucket per device that sent recently; buckets that have refilled are
    forgotten (a full bucket is the same as a new one) once more than `max_devices` are held.
    """

    def __init__(self, rate: float, burst: float | None = None, max_devices: int = 100_000) -> None:
        if rate <= 0:
            raise ValueError(f"the message rate must be > 0, got {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, BURST_SECONDS * rate)
        self.max_devices = max_devices
        self._buckets: dict[str, _Bucket] = {}
        self._swept_at = float("-inf")
        self._uncounted: Counter[str] = Counter()  # drops per device that `take_dropped` has not handed out
        self._muted: set[str] = set()  # devices whose uploads are dropped whatever the rate
        self._muted_drops: Counter[str] = Counter()  # their uploads dropped, not handed out yet
        self._lock = threading.Lock()

    def admit(self, device: str, now: float, upload: bool = False) -> bool:
        """Whether this message of `device` may be handled; False: drop it unread (and count it). `upload`:
        it is an update chunk, also dropped (after the rate's check) while the device is muted."""
        with self._lock:
            if not self._admit(device, now):
                return False
            if upload and device in self._muted:
                self._muted_drops[device] += 1
                return False
            return True

    def mute(self, device: str) -> None:
        """Drop the device's uploads from now on, until `unmute_all`."""
        with self._lock:
            self._muted.add(device)

    def unmute_all(self) -> None:
        with self._lock:
            self._muted.clear()

    def take_muted(self) -> dict[str, int]:
        """The uploads of muted devices dropped per device since the last call."""
        with self._lock:
            dropped, self._muted_drops = dict(self._muted_drops), Counter()
            return dropped

    def _admit(self, device: str, now: float) -> bool:
        bucket = self._buckets.get(device)
        if bucket is None:
            if len(self._buckets) >= self.max_devices and now - self._swept_at >= 1.0:
                self._swept_at = now  # a full scan at most once a second, however many new ids arrive
                self._forget_refilled(now)
            bucket = self._buckets[device] = _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        bucket.dropped += 1
        self._uncounted[device] += 1
        return False

    def take_dropped(self) -> dict[str, int]:
        """The messages dropped per device since the last call (the engine adds them to its counters)."""
        with self._lock:
            dropped, self._uncounted = dict(self._uncounted), Counter()
            return dropped

    def report_due(self, device: str, now: float) -> int:
        """After a drop: the number of the device's messages dropped since its last report when a
        report is due (at most one per REPORT_EVERY_S), else 0."""
        with self._lock:
            bucket = self._buckets.get(device)
            if bucket is None or bucket.dropped == 0 or now - bucket.reported_at < REPORT_EVERY_S:
                return 0
            dropped, bucket.dropped, bucket.reported_at = bucket.dropped, 0, now
            return dropped

    def _forget_refilled(self, now: float) -> None:
        full = [d for d, b in self._buckets.items() if b.tokens + (now - b.at) * self.rate >= self.burst]
        for device in full:
            del self._buckets[device]
