"""The extender's Binding writes, over HTTP/1.1 connections kept for them alone.

A Binding is one small POST per placed pod, on the extender's hot path (kube-scheduler waits for it). Through
lightkube's httpx2 client most of its CPU goes to httpcore2's connection pool and the anyio cancel scopes
around each of its reads and writes, not to the exchange. :class:`KeptConnections` is an httpx2 transport
that makes the same exchange with h11 (the HTTP/1.1 state machine httpcore2 itself drives) over plain
asyncio streams, which leaves that overhead out (the figures are in ``docs/performance.md``).
:func:`binding_client` puts it under an httpx2 client with everything of lightkube's own: base URL, default
headers, timeouts, credentials (its auth flows, token refresh and exec plugins included) and its TLS
context, so whom the extender is and whom it trusts are lightkube's, and errors are httpx2's. Where
lightkube's client would go through a proxy, Bindings stay on it.

What it keeps of httpcore2's behaviour: a connection per request in flight (binds run concurrently), idle
connections reused for ``keepalive_s`` (httpcore2's default expiry) and dropped when the server has closed
them, and each failure raised as httpx2's exception of its kind. What it adds: the answer's body is bounded
(``max_body_bytes``: a Binding answer is a small Status), and a TLS server that chose another protocol
than HTTP/1.1 is refused. One difference, for Bindings only: a request sent on a kept
connection that the server closed before answering any of it is sent once more on a fresh connection
(httpcore2 would raise). A Binding carries the pod's UID and resourceVersion as preconditions, so if the
first one did go through, the second is a 409 the extender resolves by reading the pod.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import weakref
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx2
from lightkube import AsyncClient

from kubegpu.kube.client import lightkube_http

log = logging.getLogger(__name__)

READ_CHUNK = 64 * 1024


class _Unanswered(Exception):
    """A kept connection ended before any byte of the answer: the server had closed it (see the module)."""


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    origin: tuple[bytes, bytes, int]
    loop: asyncio.AbstractEventLoop
    state: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    idle_since: float = 0.0
    answered: bool = False  # a byte of an answer has come in the current exchange

    def reusable(self, origin: tuple[bytes, bytes, int], now: float, keepalive_s: float) -> bool:
        return (self.origin == origin and self.state.our_state is h11.IDLE and not self.writer.is_closing()
                and not self.reader.at_eof() and now - self.idle_since < keepalive_s)

    def close(self) -> None:
        self.writer.close()


class KeptConnections(httpx2.AsyncBaseTransport):
    """An httpx2 transport: HTTP/1.1 through h11 on asyncio streams, idle connections kept (up to
    ``max_idle``, each for ``keepalive_s``). ``ssl_context`` serves ``https`` URLs."""

    def __init__(self, ssl_context: ssl.SSLContext | None, *, keepalive_s: float = 5.0, max_idle: int = 8,
                 max_body_bytes: int = 1 << 20) -> None:
        self._ssl = ssl_context
        self._idle: list[_Connection] = []
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self.max_body_bytes = max_body_bytes
        self.opened = 0  # connections opened so far (the tests read it)

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        body = await request.aread()
        url = request.url
        origin = (url.raw_scheme, url.raw_host, url.port or (443 if url.raw_scheme == b"https" else 80))
        kept = self._take(origin)
        if kept is not None:
            try:
                return await self._exchange(kept, request, body, timeouts, fresh=False)
            except _Unanswered:
                pass
        conn = await self._connect(origin, timeouts.get("connect"))
        return await self._exchange(conn, request, body, timeouts, fresh=True)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # ---- connections -------------------------------------------------------------------------------------
    def _take(self, origin: tuple[bytes, bytes, int]) -> _Connection | None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the likeliest still open
            if conn.loop is not loop:
                continue  # another event loop's (a test's, long gone): its loop owns and ends it
            if conn.reusable(origin, now, self.keepalive_s):
                return conn
            conn.close()
        return None

    def _keep(self, conn: _Connection) -> None:
        if conn.state.our_state is h11.DONE and conn.state.their_state is h11.DONE:
            conn.state.start_next_cycle()
            conn.idle_since = conn.loop.time()
            if len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    async def _connect(self, origin: tuple[bytes, bytes, int], timeout: float | None) -> _Connection:
        scheme, host, port = origin
        tls = scheme == b"https"
        if tls and self._ssl is None:
            raise httpx2.ConnectError("https URL without a TLS context")
        name = host.decode("ascii")
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    name, port, ssl=self._ssl if tls else None, server_hostname=name if tls else None,
                    limit=READ_CHUNK)
        except TimeoutError:
            raise httpx2.ConnectTimeout(f"connecting to {name}:{port} took over {timeout:g} s") from None
        except (OSError, ssl.SSLError) as e:
            raise httpx2.ConnectError(f"cannot connect to {name}:{port}: {e}") from e
        tls_object = writer.get_extra_info("ssl_object")
        if tls_object is not None and tls_object.selected_alpn_protocol() not in (None, "http/1.1"):
            writer.close()  # the context offered more than HTTP/1.1 and the server took it: not ours to speak
            raise httpx2.ConnectError(f"{name}:{port} chose {tls_object.selected_alpn_protocol()} over HTTP/1.1")
        self.opened += 1
        return _Connection(reader, writer, origin, asyncio.get_running_loop())

    # ---- one exchange ------------------------------------------------------------------------------------
    async def _exchange(self, conn: _Connection, request: httpx2.Request, body: bytes,
                        timeouts: dict[str, float | None], *, fresh: bool) -> httpx2.Response:
        """Send ``request`` on ``conn`` and read the whole answer; ``conn`` is kept or closed after."""
        state = conn.state
        conn.answered = False
        read_s = timeouts.get("read")
        try:
            out = state.send(h11.Request(method=request.method, target=request.url.raw_path,
                                         headers=list(request.headers.raw)))
            out += state.send(h11.Data(data=body)) if body else b""
            out += state.send(h11.EndOfMessage())
            # One deadline for the exchange: the read timeout (the answer to a small write comes whole or not).
            async with asyncio.timeout(read_s):
                conn.writer.write(out)
                await conn.writer.drain()
                head, content = await self._answer(conn, fresh=fresh)
        except _Unanswered:
            conn.close()
            raise
        except TimeoutError:
            conn.close()
            raise httpx2.ReadTimeout(f"no whole answer within {read_s} s") from None
        except h11.ProtocolError as e:
            conn.close()
            raise httpx2.RemoteProtocolError(f"invalid HTTP/1.1 answer: {e}") from None
        except OSError as e:
            conn.close()
            if not fresh and not conn.answered:  # reset by the server while kept: as closed (see the module)
                raise _Unanswered from e
            raise httpx2.ReadError(f"connection failed: {e}") from e
        except BaseException:
            conn.close()  # cancelled mid-exchange: the connection's state is unknown
            raise
        self._keep(conn)
        return httpx2.Response(head.status_code, headers=head.headers, content=content, request=request,
                               extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason})

    async def _answer(self, conn: _Connection, *, fresh: bool) -> tuple[h11.Response, bytes]:
        state = conn.state
        head: h11.Response | None = None
        chunks: list[bytes] = []
        size = 0
        while True:
            event = state.next_event()
            if event is h11.NEED_DATA:
                data = await conn.reader.read(READ_CHUNK)
                if not data and not fresh and not conn.answered:
                    raise _Unanswered
                conn.answered = True
                state.receive_data(data)  # b"": the server closed; h11 decides whether that ends the answer
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_body_bytes:
                    raise h11.RemoteProtocolError(f"answer body over {self.max_body_bytes} bytes")
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("the server closed the connection before answering")
            # h11.InformationalResponse (a 1xx): wait for the final answer


_clients: weakref.WeakKeyDictionary[AsyncClient, httpx2.AsyncClient] = weakref.WeakKeyDictionary()


def binding_client(client: AsyncClient) -> httpx2.AsyncClient:
    """The httpx2 client Bindings go through, one per lightkube client: lightkube's own
    (:func:`~kubegpu.kube.client.lightkube_http`: base URL, headers, timeouts, credentials) on
    :class:`KeptConnections` with its TLS context. Where lightkube's client would go through a proxy (from the
    environment) or keeps its TLS context where this module cannot find it, Bindings go through lightkube's
    client itself, as they did before: slower, never different."""
    kept = _clients.get(client)
    if kept is None:
        http, _ = lightkube_http(client)
        found, ctx = _direct_tls(http)
        if found:
            kept = httpx2.AsyncClient(base_url=http.base_url, headers=http.headers, timeout=http.timeout,
                                      auth=http.auth, transport=KeptConnections(ctx), trust_env=False)
        else:
            log.info("Bindings go through lightkube's own HTTP client (a proxy, or its TLS context not found)")
            kept = http
        _clients[client] = kept
    return kept


def _direct_tls(http: httpx2.AsyncClient) -> tuple[bool, ssl.SSLContext | None]:
    """Whether ``http`` reaches its base URL directly (no proxy mounted for it) and with which TLS context:
    the one lightkube built (the kubeconfig's CA and client certificate), which httpx2 keeps in its
    transport's pool. ``tests/kube/test_kube_kept_http.py`` fails if either changes."""
    transport: Any = http._transport
    if http._transport_for_url(http.base_url) is not transport:
        return False, None
    ctx = getattr(getattr(transport, "_pool", None), "_ssl_context", None)
    if isinstance(ctx, ssl.SSLContext):
        return True, ctx
    return http.base_url.scheme == "http", None  # plain HTTP needs none
