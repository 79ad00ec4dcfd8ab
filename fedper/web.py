"""Where the web agent's page is: the static root the coordinator serves (web/README.md).

The page is built from web/ by npm (`make web`: `npm --prefix web ci && npm --prefix web run build`) into
web/dist/; this module only names that folder, so the coordinator needs no knowledge of how it is made.
"""

from __future__ import annotations

from pathlib import Path

WEB_DIST = Path(__file__).resolve().parent.parent / "web" / "dist"


def web_root() -> Path:
    """The built page's folder (index.html, its modules, vendor/), which holds no page until `make web` built it
    (fedper-coordinator --web-port then says so)."""
    return WEB_DIST
