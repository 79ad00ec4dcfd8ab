"""Where the web agent's page is: the static root the coordinator serves (web/README.md).

The page is built from web/ by npm (`make web`: `npm --prefix web ci && npm --prefix web run build`) into
web/dist/; this module only names that folder, so the coordinator needs no knowledge of how it is made.
"""

from __future__ import annotations

from pathlib import Path

WEB_DIST = Path(__file__).resolve().parent.parent / "web" / "dist"
PAGE = "index.html"


class WebRootError(RuntimeError):
    """The page has not been built here."""


def web_root() -> Path:
    """The built page's folder (index.html, its modules, vendor/); WebRootError with the command that builds it."""
    if not (WEB_DIST / PAGE).is_file():
        raise WebRootError(f"the web agent's page is not built ({WEB_DIST / PAGE} is missing): run "
                           f"`make web` (npm --prefix web ci && npm --prefix web run build)")
    return WEB_DIST
