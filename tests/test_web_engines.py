"""The browser test's fleet round (tests/test_web_browser.py: join with images from the file picker, train, every
update folded, a reload that keeps the head, no head tensor on the broker) in the other engines a phone may have:
Debian's firefox-esr (puppeteer-core over WebDriver BiDi) and WebKitGTK (webkit2gtk-driver's WebKitWebDriver, on an
Xvfb display of its own when there is none); web/test/browser/engines.mjs drives them."""

from __future__ import annotations

import os
import shutil

import pytest
from test_web_browser import ROOT
from test_web_browser import test_a_browser_page_takes_part_in_fedper_rounds as fleet_round

NEEDS = {"firefox": ["firefox-esr"], "webkit": ["WebKitWebDriver"] + ([] if os.environ.get("DISPLAY") else ["Xvfb"])}

pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
    pytest.mark.skipif(not (ROOT / "web" / "dist" / "index.html").is_file(), reason="the page is not built (make web)"),
]


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", sorted(NEEDS))
def test_the_page_takes_part_in_every_engine(engine, ws_broker, tiny_artifacts, processes, tmp_path, monkeypatch):
    missing = [tool for tool in NEEDS[engine] if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (make {engine})")
    monkeypatch.setenv("ENGINE", engine)  # web/test/browser/drive.mjs launches it
    fleet_round(ws_broker, tiny_artifacts, processes, tmp_path)
