"""Serving an ASGI app with uvicorn under bounds a hostile or broken client cannot lift.

Shared by the extender and the webhook. uvicorn alone holds a connection forever while its request
headers trickle in (it only times out idle keep-alive connections), accepts any number of
connections, waits on TLS close-notify of idle keep-alive clients at shutdown, and lets the
application read a body for as long as the client takes. Here:

* :class:`GuardedHttpTools` (uvicorn's protocol on httptools' C parser, a fraction of h11's cost per
  request, which counts when kube-scheduler calls the extender three times per pod): a connection
  must deliver each request's headers within ``header_timeout_s`` of connecting or of its first
  byte (``408`` and closed otherwise); connections beyond ``max_connections`` are dropped at once; headers are capped at
  ``max_header_bytes`` (``431``); at shutdown, idle connections are aborted rather than
  closed politely;
* :func:`read_body`: the application's body reader, bounded in bytes (``413``) and in time
  (``408``), quiet when the client hangs up mid-body;
* :class:`BoundedServer`: a graceful shutdown that ends within ``shutdown_s`` whatever the clients do;
* :func:`server_context`: TLS 1.2 and 1.3 only, and in TLS 1.2 only AEAD suites with forward secrecy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

# TLS 1.2 suites: ECDHE/DHE key exchange with AES-GCM or ChaCha20-Poly1305 only (no CBC, no RSA key
# exchange). TLS 1.3 suites are all AEAD and are not affected by this string.
AEAD_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:!aNULL:!eNULL:!MD5:!DSS"


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """What one client may hold of a server."""

    max_body_bytes: int = 32 * 2**20
    header_timeout_s: float = 10.0  # connect (or first byte of a request) to its last header byte
    body_timeout_s: float = 10.0  # headers to the last body byte
    max_header_bytes: int = 16 * 1024
    max_connections: int = 1000
    max_in_flight: int = 256  # requests being answered at once; beyond, 503
    keep_alive_s: int = 30
    shutdown_s: float = 3.0


class CertificateError(ValueError):
    """A serving certificate or key that cannot be loaded (the message says which file and why)."""


def server_context(cert_file: str | Path, key_file: str | Path) -> ssl.SSLContext:
    """A server context with TLS >= 1.2, AEAD suites only. Raises :class:`CertificateError`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    harden(ctx)
    load_pair(ctx, cert_file, key_file)
    return ctx


def harden(ctx: ssl.SSLContext) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(AEAD_CIPHERS)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE


def load_pair(ctx: ssl.SSLContext, cert_file: str | Path, key_file: str | Path) -> None:
    try:
        ctx.load_cert_chain(str(cert_file), str(key_file))
    except FileNotFoundError as e:
        raise CertificateError(f"{e.filename}: no such file") from None
    except (ssl.SSLError, OSError, ValueError) as e:
        what = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise CertificateError(f"cannot load the key pair {cert_file} / {key_file}: {what} "
                               "(is each file a PEM certificate or key, not empty, and do they match?)") from None


# ---- the protocol -------------------------------------------------------------------------------
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: 32\r\nconnection: close\r\n\r\nrequest headers not sent in time")


_TOO_LARGE_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
                  b"connection: close\r\n\r\n")


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size cap, a connection cap and an
    abrupt idle shutdown."""

    limits = ServeLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._in_headers = True  # between requests, or inside a request's headers
        if len(self.connections) > self.limits.max_connections:
            log.warning("connection from %s dropped: %d connections open (limit %d)", self.client,
                        len(self.connections) - 1, self.limits.max_connections)
            transport.abort()
            return
        self._arm()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _count_header_bytes(self, data: bytes) -> bool:
        """Count what a request's headers have taken so far; False (431, closed) beyond the cap."""
        end = data.find(b"\r\n\r\n")
        self._header_bytes += len(data) if end < 0 else end
        if self._header_bytes > self.limits.max_header_bytes:  # the parsers only bound what they cannot parse
            self._disarm()
            with contextlib.suppress(Exception):
                self.transport.write(_TOO_LARGE_431)
            self.transport.close()
            return False
        return True

    def _headers_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._in_headers:
            with contextlib.suppress(Exception):
                self.transport.write(_TIMEOUT_408)
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            if self._deadline is None:
                self._arm()  # the first bytes of the next request on a kept-alive connection
                self._header_bytes = 0
            if not self._count_header_bytes(data):
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()  # the headers arrived: the app bounds the body
        super().on_headers_complete()
        if self.cycle is not None and not isinstance(self.cycle.transport, _HeadHolder):
            self.cycle.transport = _HeadHolder(self.transport, self.cycle)  # type: ignore[assignment]

    def on_response_complete(self) -> None:
        if self.cycle is not None and isinstance(self.cycle.transport, _HeadHolder):
            self.cycle.transport.flush()
        super().on_response_complete()

    def on_message_complete(self) -> None:
        self._in_headers = True  # the next bytes start the next request's headers
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._disarm()
            self.transport.abort()  # idle: no TLS close-notify round trip to wait for
        else:
            self.cycle.keep_alive = False


class _HeadHolder:
    """One response's transport as its cycle sees it: the status line and headers are held until the
    first body bytes (or the response's end) and leave with them in one write. uvicorn writes them
    apart: two sends, and over TLS two records, per answer, which cost more than a small answer itself.
    Everything else (a ``100 Continue``, closing, flow control) reaches the transport unchanged."""

    def __init__(self, transport: asyncio.Transport, cycle: Any) -> None:
        self._transport = transport
        self._cycle = cycle
        self._held = b""
        self._head_seen = False

    def write(self, data: bytes) -> None:
        if not self._head_seen and self._cycle.response_started:
            self._head_seen = True  # the first write once the response started is its head
            if self._cycle.scope["method"] != "HEAD":  # a HEAD answer has no body to carry it
                self._held = data
                return
        if self._held:
            data, self._held = self._held + data, b""
        self._transport.write(data)

    def flush(self) -> None:
        if self._held:
            held, self._held = self._held, b""
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_class(limits: ServeLimits) -> type[GuardedHttpTools]:
    return type("GuardedHttpTools", (GuardedHttpTools,), {"limits": limits})


class BoundedServer(uvicorn.Server):
    """A uvicorn server whose shutdown ends within ``config.timeout_graceful_shutdown`` (+ 1 s): what is
    still open then is aborted. ``quiet_signals`` leaves SIGTERM/SIGINT to another server in the process."""

    def __init__(self, config: uvicorn.Config, *, quiet_signals: bool = False) -> None:
        super().__init__(config)
        self._quiet_signals = quiet_signals

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        if self._quiet_signals:
            return contextlib.nullcontext()
        return super().capture_signals()

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        bound = float(self.config.timeout_graceful_shutdown or 3) + 1.0
        try:
            await asyncio.wait_for(super().shutdown(sockets), bound)
        except TimeoutError:
            for conn in list(self.server_state.connections):
                with contextlib.suppress(Exception):
                    conn.transport.abort()  # type: ignore[attr-defined]
            for t in list(self.server_state.tasks):
                t.cancel()


def config(app: Any, limits: ServeLimits, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn configuration that applies ``limits``; ``kwargs`` go to uvicorn (host, port, ssl, logs)."""
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("access_log", False)
    kwargs.setdefault("lifespan", "off")
    kwargs.setdefault("interface", "asgi3")  # apps may be bound methods, which uvicorn's guess takes for ASGI 2
    kwargs.setdefault("proxy_headers", False)  # nothing here sits behind a proxy; its middleware costs per request
    return uvicorn.Config(app, http=protocol_class(limits), limit_concurrency=limits.max_in_flight,
                          timeout_keep_alive=limits.keep_alive_s,
                          timeout_graceful_shutdown=max(1, round(limits.shutdown_s)),
                          **kwargs)


# ---- the application's side ---------------------------------------------------------------------
class BodyError(Exception):
    """The request body could not be read: ``status`` (408, 413, 499) and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, or :class:`BodyError`: 413 when it is (or says it is) larger than ``max_bytes``,
    408 when it does not arrive within ``timeout_s``, 499 when the client hung up (nothing is sent)."""
    return await receive_body(request.scope, request.receive, max_bytes, timeout_s)


async def receive_body(scope: Mapping[str, Any], receive: Callable[[], Awaitable[Mapping[str, Any]]],
                       max_bytes: int, timeout_s: float) -> bytes:
    """:func:`read_body` straight from ASGI ``receive`` (for routes served without Starlette's request
    object and middleware, which cost more than the answer on the extender's hot verbs)."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyError(413, f"request body larger than {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        # A deadline on this task (a timer), not wait_for's task per request: the verbs' bodies mostly
        # arrive whole before the first receive, and kube-scheduler sends three per pod.
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise BodyError(499, "client closed the connection before sending the whole body")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise BodyError(413, f"request body larger than {max_bytes} bytes")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise BodyError(408, f"request body not received within {timeout_s:g} s") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
