"""The coordinator's logger: device-chosen text escaped, per-device records at a bounded rate.

Whatever a device chose (its id, its software string, a value quoted in an error text) reaches the log only
as printable text: `Escaped`, the logger's filter, writes every control or invisible character of a record's
arguments as a Python escape (a newline as \\n, ESC as \\x1b), so a device can neither forge a line nor drive
an operator's terminal. Every module logs through `log`, with device data passed as arguments, never formatted
into the message itself.

Per-device records at a bounded rate, with a summary of what was left out.

A device decides how many messages it sends, so a line per message would let one device write the
coordinator's log: 50,006 refused blobs once wrote 50,006 warnings (6.8 MB in 48 s). Here each device
gets at most `burst` records per `window` seconds; the rest are counted by kind and summed up in one
line when the window ends. Only the log is bounded: the engine's counters (the state message, metrics)
still count every message. Not thread-safe: the engine's thread uses it.
"""

from __future__ import annotations

import logging
import numbers
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


def printable(text: str) -> str:
    """`text` with each character that is not printable (newlines, ESC, bidi controls) as its Python escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class Escaped(logging.Filter):
    """Rewrites a record's arguments to printable text (numbers are left for their %d/%f formats), and the
    message of an exception it carries (an internal error's may quote what a device sent)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._escaped(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: self._escaped(arg) for key, arg in record.args.items()}
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            kind, error, trace = record.exc_info
            text = str(error)
            if not text.isprintable():  # the traceback's lines are the code's; the message is escaped
                record.exc_text = ("Traceback (most recent call last):\n" + "".join(traceback.format_tb(trace)) +
                                   f"{kind.__name__ if kind else 'Exception'}: {printable(text)}")
        return True

    @staticmethod
    def _escaped(arg: object) -> object:
        if isinstance(arg, numbers.Number) or arg is None:
            return arg
        text = str(arg)
        return arg if text.isprintable() else printable(text)


log = logging.getLogger("fedper.coordinator")
log.addFilter(Escaped())

LOG_BURST = 5  # records per device per window
LOG_WINDOW_S = 10.0
MAX_WINDOWS = 10_000  # devices with an open window; beyond, newcomers share one (OTHERS)
OTHERS = "(other devices)"


@dataclass
class _Window:
    start: float
    written: int = 0
    held: Counter[str] = field(default_factory=Counter)  # records left out, by kind


class DeviceLog:
    """`log(now, device, kind, level, msg, *args)` writes to `logger` while `device` is within its burst;
    `flush(now)` (call it often: it looks at most once a second) sums up the windows that ended."""

    def __init__(self, logger: logging.Logger, burst: int = LOG_BURST, window: float = LOG_WINDOW_S,
                 max_windows: int = MAX_WINDOWS) -> None:
        self.logger, self.burst, self.window, self.max_windows = logger, burst, window, max_windows
        self._windows: dict[str, _Window] = {}
        self._flushed_at = float("-inf")

    def log(self, now: float, device: str, kind: str, level: int, msg: str, *args: Any,
            exc_info: BaseException | None = None) -> bool:
        """Write the record if `device` has records left in its window; else count it under `kind` (a short
        name such as "rejected bad_chunk") for the summary. Returns whether it was written."""
        window = self._windows.get(device)
        if window is not None and now - window.start >= self.window:
            self._summarize(device, self._windows.pop(device))
            window = None
        if window is None:
            if len(self._windows) >= self.max_windows:
                self.flush(now, force=True)
            if len(self._windows) >= self.max_windows:
                device = OTHERS
            window = self._windows.setdefault(device, _Window(now))
        if window.written >= self.burst:
            window.held[kind] += 1
            return False
        window.written += 1
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def flush(self, now: float, force: bool = False) -> None:
        """Sum up (and forget) the windows that ended; at most once a second unless `force`."""
        if not force and now - self._flushed_at < 1.0:
            return
        self._flushed_at = now
        ended = [device for device, window in self._windows.items() if now - window.start >= self.window]
        for device in ended:
            self._summarize(device, self._windows.pop(device))

    def _summarize(self, device: str, window: _Window) -> None:
        if window.held:
            kinds = ", ".join(f"{kind} {n:,}" for kind, n in window.held.most_common())
            self.logger.warning("%s: %s more log record(s) left out in %.0f s (%s); every message is counted in "
                                "the state's counters", device, f"{sum(window.held.values()):,}", self.window, kinds)
