"""The Bindings' own HTTP/1.1 connections (:mod:`kubegpu.kube.kept_http`): kept and reused, dropped when the
server closed them, bounded, failing as httpx2 does; and under lightkube's own URL, credentials and TLS."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2
import pytest

from kubegpu.kube.client import lightkube_http, make_async_client
from kubegpu.kube.kept_http import KeptConnections, binding_client
from kubegpu.webhook.certs import generate_ca, issue_serving_cert
from kubegpu_standins.apiserver import ApiServer

OK = b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

# What the scripted server does with one request on one connection: answer and keep it, answer and close it,
# close without answering, or never answer.
Reply = Callable[[asyncio.StreamWriter], Awaitable[bool]]


async def _answer(w: asyncio.StreamWriter) -> bool:
    w.write(OK)
    return True


async def _answer_close(w: asyncio.StreamWriter) -> bool:
    w.write(OK)
    return False


async def _drop(w: asyncio.StreamWriter) -> bool:
    return False


async def _hang(w: asyncio.StreamWriter) -> bool:
    await asyncio.sleep(30)
    return False


class Scripted:
    """An HTTP/1.1 server on 127.0.0.1 answering each request as the next of ``replies`` says (the last one
    repeats), recording every request's head and how many connections it accepted."""

    def __init__(self, replies: list[Reply], ssl_context: ssl.SSLContext | None = None) -> None:
        self.replies = replies
        self.ssl = ssl_context
        self.heads: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if self.ssl else 'http'}://127.0.0.1:{port}"

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await r.readexactly(length)
                self.heads.append(head)
                reply = self.replies[min(len(self.heads), len(self.replies)) - 1]
                keep = await reply(w)
                await w.drain()
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()
            self._tasks.discard(task)


def _client(base: str, transport: KeptConnections, timeout: float = 5.0) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(base_url=base, transport=transport, timeout=timeout)


def test_one_connection_serves_request_after_request() -> None:
    async def go() -> tuple[int, int, list[int]]:
        async with Scripted([_answer]) as server:
            transport = KeptConnections(None)
            async with _client(server.url, transport) as http:
                codes = [(await http.post("/x", content=b"{}")).status_code for _ in range(5)]
            return server.connections, transport.opened, codes

    assert asyncio.run(go()) == (1, 1, [201] * 5)


def test_concurrent_requests_each_get_a_connection_and_their_answer() -> None:
    async def go() -> tuple[int, int]:
        async with Scripted([_answer]) as server:
            transport = KeptConnections(None, max_idle=2)
            async with _client(server.url, transport) as http:
                answers = await asyncio.gather(*(http.post(f"/x/{k}", content=b"{}") for k in range(6)))
                assert [a.status_code for a in answers] == [201] * 6
                # afterwards, the kept ones serve again: no new connection
                opened = transport.opened
                await asyncio.gather(*(http.post("/y", content=b"{}") for _ in range(2)))
                assert transport.opened == opened
            return server.connections, opened

    connections, opened = asyncio.run(go())
    assert connections == opened and 1 <= opened <= 6


def test_a_kept_connection_the_server_has_closed_is_not_reused() -> None:
    async def go() -> tuple[int, int, list[int]]:
        async with Scripted([_answer_close, _answer]) as server:
            transport = KeptConnections(None)
            async with _client(server.url, transport) as http:
                codes = [(await http.post("/x", content=b"{}")).status_code]
                await asyncio.sleep(0.05)  # the server's close has reached the client
                codes.append((await http.post("/x", content=b"{}")).status_code)
            return transport.opened, len(server.heads), codes

    assert asyncio.run(go()) == (2, 2, [201, 201])


def test_a_request_a_kept_connection_drops_unanswered_is_sent_once_more_on_a_new_one() -> None:
    """The race a kept connection has: the server closes it as the request goes out. Sent again (a Binding's
    preconditions make a second write of one that went through a 409)."""
    async def go() -> tuple[int, int, int]:
        async with Scripted([_answer, _drop, _answer]) as server:
            transport = KeptConnections(None)
            async with _client(server.url, transport) as http:
                assert (await http.post("/x", content=b"{}")).status_code == 201
                assert (await http.post("/x", content=b"{}")).status_code == 201
            return server.connections, transport.opened, len(server.heads)

    assert asyncio.run(go()) == (2, 2, 3)


def test_a_fresh_connection_closed_unanswered_is_an_error_not_a_retry() -> None:
    async def go() -> int:
        async with Scripted([_drop]) as server:
            async with _client(server.url, KeptConnections(None)) as http:
                with pytest.raises(httpx2.RemoteProtocolError):
                    await http.post("/x", content=b"{}")
            return len(server.heads)

    assert asyncio.run(go()) == 1


def test_no_answer_within_the_read_timeout_is_a_read_timeout_and_the_connection_is_dropped() -> None:
    async def go() -> tuple[int, int]:
        async with Scripted([_hang, _answer]) as server:
            transport = KeptConnections(None)
            async with _client(server.url, transport, timeout=0.2) as http:
                with pytest.raises(httpx2.ReadTimeout):
                    await http.post("/x", content=b"{}")
                assert transport._idle == []
                assert (await http.post("/x", content=b"{}", timeout=10)).status_code == 201
                return transport.opened, len(transport._idle)

    assert asyncio.run(go()) == (2, 1)


def test_an_answer_over_the_body_bound_is_refused() -> None:
    async def huge(w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3000000\r\n\r\n" + b"x" * 3_000_000)
        return True

    async def go() -> None:
        async with Scripted([huge]) as server:
            transport = KeptConnections(None, max_body_bytes=1 << 20)
            async with _client(server.url, transport) as http:
                with pytest.raises(httpx2.RemoteProtocolError, match="over 1048576 bytes"):
                    await http.post("/x", content=b"{}")
            assert transport._idle == []

    asyncio.run(go())


def test_a_server_that_is_not_there_is_a_connect_error() -> None:
    async def go() -> None:
        async with Scripted([_answer]) as server:
            url = server.url
        async with _client(url, KeptConnections(None)) as http:
            with pytest.raises(httpx2.ConnectError):
                await http.post("/x", content=b"{}")

    asyncio.run(go())


def test_no_connection_is_kept_past_its_keep_alive() -> None:
    async def go() -> int:
        async with Scripted([_answer]) as server:
            transport = KeptConnections(None, keepalive_s=0.0)
            async with _client(server.url, transport) as http:
                for _ in range(3):
                    await http.post("/x", content=b"{}")
            return transport.opened

    assert asyncio.run(go()) == 3


def test_the_binding_client_speaks_as_lightkube_does_over_tls_with_its_credentials(tmp_path: Path) -> None:
    """lightkube's CA (from the kubeconfig), token and user agent reach the server through the kept connections;
    a server certificate the CA did not sign is refused."""
    ca, other_ca = generate_ca("cluster-ca"), generate_ca("someone-else")
    serving = issue_serving_cert(ca, ["127.0.0.1"])
    serving.write(tmp_path / "tls.crt", tmp_path / "tls.key")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")

    def kubeconfig(url: str, ca_pem: bytes, name: str) -> Path:
        (tmp_path / f"{name}.pem").write_bytes(ca_pem)
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
               "clusters": [{"name": "c", "cluster": {"server": url,
                                                      "certificate-authority": str(tmp_path / f"{name}.pem")}}],
               "users": [{"name": "u", "user": {"token": "s3cret"}}],
               "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}
        path = tmp_path / f"{name}.kubeconfig"
        path.write_text(json.dumps(cfg))
        return path

    async def go() -> list[bytes]:
        async with Scripted([_answer], ssl_context=server_ctx) as server:
            client = make_async_client(kubeconfig(server.url, ca.cert_pem, "ours"))
            answer = await binding_client(client).post("api/v1/namespaces/ns/pods/p/binding", content=b"{}")
            assert answer.status_code == 201 and answer.json() == {}
            assert binding_client(client) is binding_client(client)  # one per lightkube client
            # over the kept connections with lightkube's TLS context, not the fallback to lightkube's client
            assert binding_client(client) is not lightkube_http(client)[0]
            stranger = make_async_client(kubeconfig(server.url, other_ca.cert_pem, "theirs"))
            with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await binding_client(stranger).post("api/v1/namespaces/ns/pods/p/binding", content=b"{}")
            return server.heads

    heads = asyncio.run(go())
    assert len(heads) == 1
    head = heads[0].lower()
    assert head.startswith(b"post /api/v1/namespaces/ns/pods/p/binding http/1.1")
    assert b"authorization: bearer s3cret" in head


def test_a_proxy_lightkube_would_use_keeps_bindings_on_lightkubes_own_client(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ApiServer() as api:
        direct = make_async_client(api.write_kubeconfig(tmp_path / "kubeconfig"))
        assert binding_client(direct) is not lightkube_http(direct)[0]
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        proxied = make_async_client(api.write_kubeconfig(tmp_path / "kubeconfig"))
        assert binding_client(proxied) is lightkube_http(proxied)[0]


def test_a_server_that_chooses_http2_is_refused_not_misspoken(tmp_path: Path) -> None:
    ca = generate_ca("cluster-ca")
    issue_serving_cert(ca, ["127.0.0.1"]).write(tmp_path / "tls.crt", tmp_path / "tls.key")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server_ctx.set_alpn_protocols(["h2"])
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    client_ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    client_ctx.set_alpn_protocols(["h2", "http/1.1"])

    async def go() -> None:
        async with Scripted([_answer], ssl_context=server_ctx) as server, \
                _client(server.url, KeptConnections(client_ctx)) as http:
            with pytest.raises(httpx2.ConnectError, match="chose h2"):
                await http.post("/x", content=b"{}")

    asyncio.run(go())
