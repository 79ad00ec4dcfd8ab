"""The page in every browser engine a phone may have (Debian's chromium, firefox-esr and WebKitGTK, as
web/test/browser/engines.mjs drives them): per engine and width, the wasm threads the page really gets, its training
samples/s and session start (web/test/browser/bench.mjs, the page's own modules on a cross-origin isolated page), and
the tab's memory while it trains: the peak resident set (VmRSS in /proc/PID/status, sampled every 0.2 s) of the
process that holds the page, chromium's renderer, firefox's content process of type "tab" or WebKit's
WebKitWebProcess, the largest of them where there are several.

    python benchmarks/web_engines.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import main, median, table, write_json

from fedper.coordinator.web import WebServer
from fedper.export.exporter import export_artifacts
from web import BATCH, WEB

ENGINES = {"chromium": "chromium", "firefox": "firefox-esr", "webkit": "WebKitWebDriver"}


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def holds_a_page(engine: str, words: list[str]) -> bool:
    """Whether a process of `engine` renders web content, from its command line's words (chromium and firefox
    rewrite theirs into one space-separated string)."""
    if engine == "chromium":
        return "--type=renderer" in words
    if engine == "firefox":
        return "-contentproc" in words and words[-1] == "tab"
    return bool(words) and Path(words[0]).name == "WebKitWebProcess"


def tab_rss_mb(pid: int, engine: str) -> float:
    """The largest resident set, in MB, of the processes below `pid` that render a page."""
    largest = 0.0
    for child in descendants(pid):
        try:
            words = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
            if holds_a_page(engine, words):
                status = Path(f"/proc/{child}/status").read_text()
                rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
                largest = max(largest, rss_kb / 1000)
        except (OSError, StopIteration):
            continue
    return largest


def engine_speed(export: Path, engine: str, threads: int, samples: int, repeats: int) -> dict[str, Any]:
    """bench.mjs in `engine` for `export`, with the tab's peak memory while it runs."""
    with WebServer(WEB / "dist", export, "bench", "ws://127.0.0.1:9/", host="127.0.0.1") as server:
        command = ["node", str(WEB / "test" / "browser" / "bench.mjs"), server.url().rstrip("/"), str(threads),
                   str(samples), str(BATCH), str(repeats)]
        with subprocess.Popen(command, cwd=WEB, env={**os.environ, "ENGINE": engine}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as node:
            peak = 0.0
            while node.poll() is None:
                peak = max(peak, tab_rss_mb(node.pid, engine))
                time.sleep(0.2)
            out, err = node.communicate()
    if node.returncode:
        raise RuntimeError(f"the page's benchmark in {engine} failed: {err[-2000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "tabPeakMB": peak}


def run(out: Path, quick: bool = False) -> str:
    if not (WEB / "dist" / "index.html").is_file():
        return "web engines: skipped (build the page with `make web`)"
    engines = [e for e, tool in ENGINES.items() if shutil.which(tool)]
    widths, samples, repeats = ((0.25,), 128, 2) if quick else ((0.25, 0.5, 1.0), 256, 3)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for width in widths:
            export = Path(tmp) / f"w{width}"
            export_artifacts(export, model="mobilenet_v1", kp=0, num_classes=10, input_size=32, width=width,
                             algorithm="fedavg")
            for engine in engines:
                page = engine_speed(export, engine, 2, samples, repeats)
                results[f"{engine}-{width}"] = page
                rows.append([engine, width, page["threads"], "yes" if page["isolated"] else "no",
                             median(page["samplesPerS"]), page["startS"], round(page["tabPeakMB"])])
    write_json(out, "web_engines", {"batch": BATCH, "samples": samples, "results": results})
    missing = sorted(set(ENGINES) - set(engines))
    return (f"MobileNet-v1, 32x32, batch {BATCH}, 2 wasm threads asked for"
            + (f" ({', '.join(missing)} not installed)" if missing else "") + ":\n\n"
            + table(["engine", "width", "threads", "isolated", "samples/s", "session start s", "tab peak MB"], rows))


if __name__ == "__main__":
    main(run, __doc__, quick="width 0.25 only, 128 samples, 2 repeats")
