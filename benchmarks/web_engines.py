"""The page in every browser engine a phone may have (Debian's chromium, firefox-esr and WebKitGTK, as
web/test/browser/engines.mjs drives them) at MobileNet-v1 widths 0.25, 0.5 and 1.0: per engine and width, the wasm
threads the page really gets, its training samples/s and session start (web/test/browser/bench.mjs, the page's own
modules on a cross-origin isolated page), and the tab's memory while it trains: the peak resident set (VmRSS in
/proc/PID/status, sampled every 0.2 s) of the process that holds the page, chromium's renderer, firefox's content
process of type "tab" or WebKit's WebKitWebProcess, the largest of them where there are several (benchmarks/web.py's
page_speed).

    python benchmarks/web_engines.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import main, write_json

from fedper.export.exporter import export_artifacts
from web import BATCH, WEB, engines_table


def run(out: Path, quick: bool = False) -> str:
    if not (WEB / "dist" / "index.html").is_file():
        return "web engines: skipped (build the page with `make web`)"
    widths, samples, repeats = ((0.25,), 128, 2) if quick else ((0.25, 0.5, 1.0), 256, 3)
    with tempfile.TemporaryDirectory() as tmp:
        exports = {}
        for width in widths:
            exports[width] = Path(tmp) / f"w{width}"
            export_artifacts(exports[width], model="mobilenet_v1", kp=0, num_classes=10, input_size=32, width=width,
                             algorithm="fedavg")
        text, results = engines_table(exports, samples, repeats)
    write_json(out, "web_engines", {"batch": BATCH, "samples": samples, "results": results})
    return f"MobileNet-v1, 32x32, batch {BATCH}. {text}"


if __name__ == "__main__":
    main(run, __doc__, quick="width 0.25 only, 128 samples, 2 repeats")
