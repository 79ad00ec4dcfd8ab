"""`fedper-coordinator --web-port`: the web agent's page, the export and the page's settings over HTTP.

A phone joins a fleet by opening one URL: this serves the page's folder at `/`, the export read-only at
`/artifacts/` and `/config.json` (the broker's WebSocket URL, the fleet). Every response carries the
cross-origin isolation headers that let onnxruntime-web use wasm threads (COOP + COEP, CORP for each
resource). GET and HEAD only; paths are checked segment by segment, so nothing outside the two folders
is reachable and no directory is listed (docs/operations.md, "Phones: the web agent").

It listens on every interface by default, so it bounds what a stranger can hold: at most MAX_CONNECTIONS
connections (one thread each; a new one sheds the oldest that has not finished sending its request), a
request's line and headers within HEADER_TIMEOUT_S of its connection, and every read or write within
IO_TIMEOUT_S. With --web-cert/--web-key it speaks https (a phone gets a secure context: crypto, threads).
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import logging
import re
import shutil
import socket
import ssl
import struct
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from fedper.coordinator.config import Group, option

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("fedper.coordinator")

ARTIFACTS_PREFIX = "/artifacts/"
# The page's module workers and wasm need exact types (a browser refuses a module or a streamed wasm otherwise).
MIME_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
              ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
              ".json": "application/json", ".wasm": "application/wasm", ".onnx": "application/octet-stream",
              ".ort": "application/octet-stream", ".safetensors": "application/octet-stream",
              ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon", ".txt": "text/plain; charset=utf-8",
              ".webmanifest": "application/manifest+json"}
# Cross-origin isolation (crossOriginIsolated, hence SharedArrayBuffer and wasm threads), on every response.
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp",
                     "Cross-Origin-Resource-Policy": "same-origin", "X-Content-Type-Options": "nosniff"}
MAX_CONNECTIONS = 64
HEADER_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 30.0
_HOST_HEADER = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253})(:\d{1,5})?$")


@dataclass(frozen=True)
class Web(Group):
    """The page's server: options of the command (beside Service in coordinator/cli.py), not of the engine."""

    title = "Web agent page (docs/operations.md)"
    port: int | None = option(None, "Serve the web agent's page at /, the export at /artifacts/ and /config.json "
                                    "on this HTTP port (default: off; 0 picks a free one).", flag="--web-port",
                              min=0, max=65535)
    host: str = option("0.0.0.0", "Address the page listens on (phones on the LAN need a non-loopback one).",
                       flag="--web-host")
    broker: str | None = option(None, "WebSocket URL the page reaches the broker at, ws://HOST:PORT/PATH or "
                                      "wss://... (default with --embedded-broker: its WebSocket listener on "
                                      "--web-ws-port).", flag="--web-broker")
    ws_port: int = option(0, "With --embedded-broker and --web-port: its WebSocket listener's port (0: a free "
                             "one).", flag="--web-ws-port", min=0, max=65535)
    root: Path | None = option(None, "The page's folder (default: the web agent's, fedper.web_root()).",
                               flag="--web-root")
    cert: Path | None = option(None, "Serve the page over https with this PEM certificate (chain) file, which "
                                     "phones must trust (deploy/README.md); needs --web-key.", flag="--web-cert")
    key: Path | None = option(None, "The PEM private key of --web-cert.", flag="--web-key")


def default_root() -> Path | None:
    """The web agent's page folder, once the package ships it (`fedper.web_root()`); else None."""
    import fedper

    web_root: Callable[[], Path] | None = getattr(fedper, "web_root", None)
    return Path(web_root()) if web_root else None


def check_root(root: Path | None) -> Path:
    """The page's folder, resolved; ValueError with one line when it is missing or no page."""
    if root is None:
        raise ValueError("--web-port needs --web-root DIR: this install has no web agent page (fedper.web_root)")
    if not (root / "index.html").is_file():
        raise ValueError(f"--web-root {root}: no index.html there")
    return root.resolve()


def check_broker_url(url: str) -> str:
    """A ws:// or wss:// URL with a host; ValueError otherwise (mqtt:// is not what a browser can open)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"--web-broker {url!r}: give the WebSocket URL phones reach the broker at, "
                         "ws://HOST:PORT/PATH or wss://HOST/PATH")
    return url


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server side of https with the operator's certificate; ValueError with one line when it does not load."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--web-cert {cert} / --web-key {key}: cannot load them: {e}") from None
    return context


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bound on connections (threads) and on the time a request may take to arrive."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[_Handler], max_connections: int,
                 header_timeout_s: float, tls: ssl.SSLContext | None) -> None:
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self._lock = threading.Condition()
        self._open = 0  # connection threads not yet ended
        self._arriving: dict[socket.socket, float] = {}  # connections whose request is not read yet, oldest first
        super().__init__(address, handler)
        if tls:  # the handshake happens in the connection's thread, under its timeouts, not in the accept loop
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def process_request(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        with self._lock:
            self._expire(time.monotonic())
            if self._open >= self.max_connections:
                if not self._arriving:  # every thread is sending a response: this one waits its turn elsewhere
                    _close(request)
                    return
                oldest = next(iter(self._arriving))
                del self._arriving[oldest]
                _cut(oldest)
                # its thread ends at once; until it has, no thread starts, so the bound holds for threads too
                if not self._lock.wait_for(lambda: self._open < self.max_connections, timeout=1.0):
                    _close(request)
                    return
            self._open += 1
            self._arriving[request] = time.monotonic()
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open -= 1
                self._lock.notify()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-response (a shed connection, a closed tab) is routine, not a traceback."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def service_actions(self) -> None:
        with self._lock:
            self._expire(time.monotonic())

    def arrived(self, request: socket.socket) -> None:
        """The connection's request line and headers are in: it is no longer a candidate for shedding."""
        with self._lock:
            self._arriving.pop(request, None)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self._lock:
            self._arriving.pop(request, None)
        super().shutdown_request(request)

    def _expire(self, now: float) -> None:
        for request, since in list(self._arriving.items()):
            if now - since > self.header_timeout_s:
                del self._arriving[request]
                _cut(request)


def _cut(request: socket.socket) -> None:
    """Wake the connection's thread from its read with end of file (the thread then closes it)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(request, socket.SHUT_RDWR)


def _close(request: socket.socket) -> None:
    with contextlib.suppress(OSError):
        socket.socket.close(request)


class WebServer:
    """A threaded HTTP(S) server for the page, running beside the MQTT service until `close()`."""

    def __init__(self, root: Path, artifacts: Path, fleet: str, broker: str | Callable[[str], str],
                 host: str = "0.0.0.0", port: int = 0, *, tls: ssl.SSLContext | None = None,
                 max_connections: int = MAX_CONNECTIONS, header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        """`broker`: the URL for config.json, or a function of the host name the page was requested with; `tls`:
        https with it. OSError when the port cannot be bound."""
        site = _Site(root.resolve(), artifacts.resolve(), fleet, broker)
        handler = type("Handler", (_Handler,), {"site": site})
        self._server = _BoundedServer((host, port), handler, max_connections, header_timeout_s, tls)
        self.host, self.port, self.scheme = host, self._server.server_address[1], "https" if tls else "http"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fedper-web", daemon=True)

    def start(self) -> WebServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def url(self) -> str:
        """The URL to open: on a wildcard address, this machine's first non-loopback IPv4 address."""
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = lan_address() or socket.gethostname()
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/"

    def loopback(self) -> bool:
        """Whether only this machine can open the page (it listens on a loopback address)."""
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    def __enter__(self) -> WebServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def lan_address() -> str | None:
    """This machine's first non-loopback IPv4 address, read from its interfaces (Linux; sends nothing)."""
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    return None


def _secure_for_https(url: str) -> bool:
    """Whether an https page may open this broker URL: wss://, or ws:// to a loopback host (a browser allows that)."""
    parts = urlsplit(url)
    return parts.scheme == "wss" or (parts.scheme == "ws" and (parts.hostname or "") in ("localhost", "127.0.0.1",
                                                                                         "::1"))


def announce(page: WebServer, fleet: str, echo: Callable[[str], Any]) -> None:
    """The URL to open, said honestly: a QR code only for an address a phone can reach, and what plain http lacks."""
    url = page.url()
    if page.loopback():
        echo(f"web agent of fleet {fleet}: open {url} on this machine only (a loopback address: phones cannot reach "
             "it; --web-host 0.0.0.0 or this machine's LAN address for them)")
        return
    if page.host in ("0.0.0.0", "", "::") and lan_address() is None:
        echo(f"web agent of fleet {fleet}: open {url} (this machine has no LAN IPv4 address: that name must resolve "
             "on the phone)")
    else:
        echo(f"web agent of fleet {fleet}: open {url} (a phone on this network: scan the code)")
    print_qr(url, echo)
    if page.scheme == "http":
        echo("plain http: a phone gets no secure context there, so one wasm thread (no cross-origin isolation) and no "
             "Wake Lock; give --web-cert/--web-key for https (deploy/README.md)")


def print_qr(url: str, echo: Callable[[str], Any]) -> None:
    """The URL as a QR code in the terminal (segno, from the coordinator extra), or a one-line hint."""
    try:
        import segno
    except ImportError:
        echo("(pip install segno for a QR code of it)")
        return
    import io

    out = io.StringIO()
    segno.make(url, error="m").terminal(out=out, compact=True)
    echo(out.getvalue().rstrip("\n"))


@dataclass(frozen=True)
class _Site:
    """What the server serves: the page's folder, the export, and config.json's fleet and broker URL."""

    root: Path
    artifacts: Path
    fleet: str
    broker: str | Callable[[str], str]


class _Handler(BaseHTTPRequestHandler):
    """GET/HEAD of the page's files, the export's files and config.json; everything else 404 or 405."""

    site: _Site
    server: _BoundedServer
    server_version = "fedper-web"
    sys_version = ""
    timeout = IO_TIMEOUT_S  # every read and write of the connection, the TLS handshake's included

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers
        self.server.arrived(self.connection)
        return parsed

    def do_GET(self) -> None:
        self._respond(body=True)

    def do_HEAD(self) -> None:
        self._respond(body=False)

    def _refuse(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def end_headers(self) -> None:
        for name, value in ISOLATION_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("web %s: " + format, self.address_string(), *args)

    def _respond(self, body: bool) -> None:
        path = urlsplit(self.path).path
        if path == "/config.json":
            config = {"broker": self._broker_url(), "fleet": self.site.fleet, "artifacts": "artifacts/"}
            data = json.dumps(config).encode()
            self._head("application/json", len(data))
            if body:
                self.wfile.write(data)
            return
        if path.startswith(ARTIFACTS_PREFIX):
            file = _inside(self.site.artifacts, path[len(ARTIFACTS_PREFIX):], index=None)
        else:
            file = _inside(self.site.root, path.lstrip("/"), index="index.html")
        if file is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        stat = file.stat()
        etag = f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'
        if self.headers.get("If-None-Match") == etag:
            self.send_response(HTTPStatus.NOT_MODIFIED)
            self.send_header("ETag", etag)
            self.end_headers()
            return
        self._head(_mime_type(file), stat.st_size, ETag=etag,
                   **{"Last-Modified": email.utils.formatdate(stat.st_mtime, usegmt=True)})
        if body:
            with file.open("rb") as f, contextlib.suppress(ConnectionError):
                shutil.copyfileobj(f, self.wfile)

    def _broker_url(self) -> str:
        if isinstance(self.site.broker, str):
            return self.site.broker
        match = _HOST_HEADER.match(self.headers.get("Host", ""))
        return self.site.broker(match.group(1) if match else self.server.server_address[0])

    def _head(self, mime: str, length: int, **headers: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(length))
        self.send_header("Cache-Control", "no-cache")  # revalidated by ETag: a new export or page is seen at once
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()


def _inside(folder: Path, relative: str, index: str | None) -> Path | None:
    """The regular file `relative` names inside `folder` (a folder's `index`, if given), or None: no empty,
    `.`/`..` or hidden segment, nothing that resolves (symlinks followed) outside `folder`, no listing."""
    relative = unquote(relative)
    if index and relative.endswith("/"):
        relative = relative[:-1]
    segments = relative.split("/") if relative else []
    if any(s in ("", ".", "..") or s.startswith(".") or "\\" in s or "\0" in s for s in segments):
        return None
    candidate = folder.joinpath(*segments)
    if candidate.is_dir() and index:
        candidate = candidate / index
    try:
        resolved = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if not resolved.is_relative_to(folder) or not resolved.is_file():
        return None
    return resolved


def _mime_type(file: Path) -> str:
    return MIME_TYPES.get(file.suffix.lower(), "application/octet-stream")


def serve_page(web: Web, artifacts: Path, fleet: str, ws_port: int | None) -> WebServer:
    """The page's server, started; `ws_port`: the embedded broker's WebSocket listener, the default broker URL.
    ValueError (a bad option) or OSError (the port) with one line."""
    root = check_root(web.root or default_root())
    if (web.cert is None) != (web.key is None):
        raise ValueError("--web-cert and --web-key go together: the certificate and its private key")
    if web.cert and not (web.broker and _secure_for_https(web.broker)):
        raise ValueError("--web-cert: an https page may reach its broker only over wss:// (browsers refuse ws:// "
                         "from it): give --web-broker wss://HOST/PATH (nginx in front, deploy/README.md)")
    if web.broker:
        broker: str | Callable[[str], str] = check_broker_url(web.broker)
    elif ws_port is not None:
        def broker(host: str) -> str:  # the host the phone reached the page at reaches the broker too
            return f"ws://{host}:{ws_port}"
    else:
        raise ValueError("--web-port needs --web-broker URL, the WebSocket URL phones reach the broker at (e.g. "
                         "wss://fleet.example/mqtt, deploy/README.md), or --embedded-broker")
    tls = tls_context(web.cert, web.key) if web.cert and web.key else None
    try:
        server = WebServer(root, artifacts, fleet, broker, web.host, web.port or 0, tls=tls)
    except OSError as e:
        raise OSError(f"cannot serve the page on {web.host}:{web.port}: {e.strerror or e}") from None
    return server.start()
