"""A free loopback port, for the processes one machine starts (a demo's broker, the emulator's rendezvous)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the OS picks it; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
