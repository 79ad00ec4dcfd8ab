"""The web agent's page served for the browser test and benchmarks/web.py: the built root at /, an export at
/artifacts/, /config.json, with the cross-origin isolation headers that wasm threads need (web/README.md has the
contract). A stand-in for fedper-coordinator --web-port where that is not wanted or not there."""

from __future__ import annotations

import json
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from PIL import Image

from fedper.data import load_digits
from fedper.ports import free_port


class PageServer(ThreadingHTTPServer):
    def __init__(self, root: Path, artifacts: Path, config: dict) -> None:
        self.artifacts, self.config = artifacts, json.dumps(config).encode()
        super().__init__(("127.0.0.1", free_port()), partial(_Handler, directory=str(root)))

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> PageServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(SimpleHTTPRequestHandler):
    server: PageServer

    def translate_path(self, path: str) -> str:
        if path.startswith("/artifacts/"):
            return str(self.server.artifacts / path.removeprefix("/artifacts/").split("?")[0])
        return super().translate_path(path)

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/config.json":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(self.server.config)
            return
        super().do_GET()

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_message(self, *args: object) -> None:
        pass


def write_images(folder: Path, classes: tuple[int, ...], count: int, offset: int) -> None:
    """Digits as PNG files in class folders, as a phone's photo library would hand them to the file picker."""
    ds = load_digits(32).train
    idx = np.flatnonzero(np.isin(ds.y, classes))[offset : offset + count]
    for i in idx:
        (folder / str(ds.y[i])).mkdir(parents=True, exist_ok=True)
        Image.fromarray(ds.x[i]).save(folder / str(ds.y[i]) / f"digit-{i:04d}.png")
