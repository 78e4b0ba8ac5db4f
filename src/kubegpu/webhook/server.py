"""Serving the webhook app over TLS with uvicorn, with the certificate reloader attached.

``run`` blocks (the ``kubegpu webhook`` command); ``start`` runs the server in a
thread on an already-bound socket (port 0 gives an ephemeral port) and returns
once it accepts connections, for the tests and the benchmark.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

import uvicorn

from kubegpu import httpserve
from kubegpu.httpserve import BoundedServer, ServeLimits
from kubegpu.webhook.app import WebhookMetrics, WebhookSettings, create_app
from kubegpu.webhook.review import MAX_BODY_BYTES
from kubegpu.webhook.tls import CertReloader

log = logging.getLogger(__name__)


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[v6]:PORT`` -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class WebhookServer:
    def __init__(self, settings: WebhookSettings, cert_file: str, key_file: str, *,
                 host: str = "127.0.0.1", port: int = 0, cert_poll_s: float = 2.0,
                 log_level: str = "warning", limits: ServeLimits | None = None) -> None:
        self.limits = limits or ServeLimits(max_body_bytes=MAX_BODY_BYTES)
        self.metrics = WebhookMetrics()
        self.reloader = CertReloader(cert_file, key_file, on_reload=self._reloaded)  # CertificateError
        self.metrics.cert_not_after.set(self.reloader.not_after.timestamp())
        self.cert_poll_s = cert_poll_s
        self.app = create_app(settings, self.metrics, self.limits)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto must say TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto is
        # IPPROTO_TCP, and without it every response (headers, then body) waits 40 ms for a delayed ACK.
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind((host, port))
        # Listen now, so a client told the port (the log line, the tests) queues instead of being refused.
        self.sock.listen(2048)
        self.port: int = self.sock.getsockname()[1]
        def context_factory(_config: uvicorn.Config,
                            _default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
            return self.reloader.context

        config = httpserve.config(self.app, self.limits, log_level=log_level, ssl_context_factory=context_factory)
        self.server = BoundedServer(config)
        self._thread: threading.Thread | None = None

    def _reloaded(self, ok: bool, _error: str) -> None:
        self.metrics.cert_reloads.labels("ok" if ok else "error").inc()
        if ok:
            self.metrics.cert_not_after.set(self.reloader.not_after.timestamp())

    def run(self) -> None:
        """Serve until SIGINT/SIGTERM."""
        self.reloader.start(self.cert_poll_s)
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.reloader.stop()

    def start(self, timeout_s: float = 10.0) -> int:
        """Serve in a background thread; returns the port once the server is up."""
        self.reloader.start(self.cert_poll_s)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="webhook-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("webhook server did not start")
            time.sleep(0.01)
        return self.port

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.reloader.stop()
        self.sock.close()
